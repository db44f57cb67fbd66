from tests.launch.conftest import launch  # noqa: F401 - the real-launch fixture, shared with the launch tests
