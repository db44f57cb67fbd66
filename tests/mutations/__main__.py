import sys

from tests.mutations.run import main

sys.exit(main())
