"""DeepSpeed configs translate key by key: mapped, warned about or refused by name, never dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerorun import config
from zerorun.config import ds_config
from zerorun.config.ds_config import Batch
from zerorun.config.ds_keys import RULES, Level
from zerorun.errors import ConfigError


def _notes(t: ds_config.Translation, level: Level) -> dict[str, str]:
    return {n.key: n.message for n in t.notes if n.level is level}


def test_deepspeed_defaults_that_differ_from_zeroruns_are_written_out() -> None:
    t = ds_config.translate({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {}},
                             "fp16": {"enabled": True}})
    assert t.data["zero"]["stage"] == 0  # DeepSpeed without zero_optimization: no ZeRO
    assert t.data["optimizer"] == {"type": "adamw", "weight_decay": 0.0, "lr": 1e-3, "betas": [0.9, 0.999],
                                   "eps": 1e-8}  # "Adam" is AdamW unless adam_w_mode is false
    assert t.data["precision"] == {"dtype": "fp16", "hysteresis": 2, "initial_loss_scale": 65536.0}
    assert t.data["train"] == {"micro_batch_size": 4, "grad_accum_steps": 1}


def test_adam_w_mode_false_is_l2_adam_and_a_static_loss_scale_is_not_dynamic() -> None:
    t = ds_config.translate({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "loss_scale": 128},
                             "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "lr": 0.1}}})
    assert t.data["optimizer"]["type"] == "adam" and t.data["optimizer"]["lr"] == 0.1
    assert t.data["precision"]["initial_loss_scale"] == 128.0 and t.data["precision"]["dynamic_loss_scale"] is False


@pytest.mark.parametrize("given, world, expected", [
    ((32, 4, None), 2, (4, 4, 32)),      # micro given: accumulation derived
    ((32, None, 2), 4, (4, 2, 32)),      # accumulation given: micro derived
    ((32, None, None), 4, (8, 1, 32)),   # train_batch_size alone: accumulation 1
    ((None, 4, 3), 2, (4, 3, 24)),       # no train_batch_size: it follows
    ((24, 4, 3), 2, (4, 3, 24)),         # all three: checked
])
def test_batch_follows_deepspeeds_rule(given: tuple, world: int, expected: tuple) -> None:
    assert Batch(*given).resolve(world) == expected


def test_a_batch_that_does_not_split_is_refused_naming_the_rule() -> None:
    with pytest.raises(ValueError, match=r"train_batch_size 24 != .* 4 x .* 3 x world size 4"):
        Batch(24, 4, 3).resolve(4)
    t = ds_config.translate({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert "train_batch_size" in _notes(t, Level.ERROR)


def test_unsupported_keys_are_refused_or_warned_by_name() -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9,
                                "zero_hpz_partition_size": 2},
          "pipeline": {"stages": 2}, "tensorboard": {"enabled": True, "output_path": "tb"},
          "gradient_clippping": 1.0, "my_own_key": 3, "amp": {"enabled": False}}
    t = ds_config.translate(ds)
    errors, warnings = _notes(t, Level.ERROR), _notes(t, Level.WARNING)
    assert set(errors) == {"optimizer.type", "pipeline", "gradient_clippping"}
    assert t.data["zero"]["hpz_partition_size"] == 2  # hpZ is mapped
    assert "did you mean gradient_clipping" in errors["gradient_clippping"]
    assert {"zero_optimization.sub_group_size", "zero_optimization.stage3_max_live_parameters", "tensorboard",
            "my_own_key"} <= set(warnings)
    assert "amp" not in errors  # disabled: harmless
    with pytest.raises(ConfigError) as err:
        ds_config.check(t, "ds.json")
    assert "ds.json: pipeline: not supported" in str(err.value) and "3 DeepSpeed key(s)" in str(err.value)


def test_every_key_of_the_input_gets_exactly_one_outcome() -> None:
    ds = json.loads((Path(__file__).parent / "configs" / "zero3_nvme.json").read_text())
    t = ds_config.translate(ds, world_size=8)
    leaves = {k for k, _ in ds_config._leaves(ds)}
    handled = {k for k in leaves if RULES.get(k) and RULES[k].handled}
    accounted = set(t.origins.values()) | {n.key for n in t.notes} | handled
    assert leaves <= accounted, leaves - accounted


def test_auto_leaves_zeroruns_default_and_is_listed_with_the_recipe_keys_it_stands_for() -> None:
    t = ds_config.translate({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                             "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                             "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert t.autos == {"optimizer.params.lr": "optimizer.lr", "gradient_clipping": "train.clip_grad_norm",
                       "train_batch_size": "train.global_batch_size",
                       "train_micro_batch_size_per_gpu": "train.micro_batch_size", "bf16.enabled": "precision.dtype"}
    assert "clip_grad_norm" not in t.data.get("train", {}) and t.data["precision"]["dtype"] == "fp32"
    assert not t.errors and not t.warnings


def test_auto_is_one_line_the_script_fills_them_or_zeroruns_values_named_with_them() -> None:
    t = ds_config.translate({"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    filled = ds_config.auto_line(t, "ds.json", filled_by_script=True)
    assert filled == ("zerorun: ds.json: \"auto\" in 2 keys (gradient_clipping, optimizer.params.lr): the script fills "
                      "them in (transformers and accelerate do, from its own arguments) when it calls "
                      "deepspeed.initialize; zerorun trains with those values and prints them then (one still \"auto\" "
                      "there is refused).")
    alone = ds_config.auto_line(t, "ds.json", filled_by_script=False,
                                values={"optimizer.lr": 0.001, "train.clip_grad_norm": None})
    assert alone is not None and alone.startswith("zerorun: warning: ds.json: \"auto\" in 2 keys and nothing to fill")
    assert alone.endswith("zerorun's values apply: gradient_clipping -> train.clip_grad_norm null; "
                          "optimizer.params.lr -> optimizer.lr 0.001.")
    assert ds_config.auto_line(ds_config.translate({"gradient_clipping": 1.0}), "ds.json", True) is None


def test_a_trainer_launch_says_once_that_the_script_fills_auto_and_warns_of_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_path = tmp_path / "ds.json"  # a path of its own: each line is printed once per process
    config_path.write_text((Path(__file__).parent / "configs" / "hf_trainer_zero2.json").read_text())
    (tmp_path / "r.yaml").write_text(f"script: t.py\ndeepspeed_config: {config_path}\nlaunch: {{deepspeed_compat: true}}\n")
    config.load(tmp_path / "r.yaml", check_script=False)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"zerorun: {config_path}: \"auto\" in 13 keys (optimizer.params.lr,") and "warning" not in line
    (tmp_path / "plain.yaml").write_text(f"script: t.py\ndeepspeed_config: {config_path}\n")  # a zerorun script
    config.load(tmp_path / "plain.yaml", check_script=False)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"zerorun: warning: {config_path}: \"auto\" in 13 keys and nothing to fill them in")
    assert "optimizer.params.lr -> optimizer.lr 0.001;" in line


def test_at_initialize_zerorun_says_what_the_script_filled_in_and_warns_only_where_it_overrides_the_user(
        tmp_path: Path) -> None:
    from zerorun.compat import filled

    config_path = Path(__file__).parent / "configs" / "hf_trainer_zero2.json"
    (tmp_path / "r.yaml").write_text(f"script: t.py\ndeepspeed_config: {config_path}\nlaunch: {{deepspeed_compat: true}}\n")
    launched = config.load(tmp_path / "r.yaml", ["optimizer.weight_decay=0.1"], check_script=False)
    given = json.loads(config_path.read_text())  # as transformers fills it from --learning_rate 5e-5 ...
    given["optimizer"]["params"] = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    given["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": 5e-5, "warmup_num_steps": 1}
    given.update(gradient_clipping=1.0, train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    given["fp16"]["enabled"] = given["bf16"]["enabled"] = False
    from zerorun.compat.api import recipe_for

    recipe, _ = recipe_for(given, launched, world_size=2, rank=1)  # rank 1 prints nothing
    translation = ds_config.translate(given, 2)
    shown = filled.lines(given, translation, "initialize(config=...)", launched, recipe)
    assert len(shown) == 2, shown
    assert shown[0].startswith(f"zerorun: initialize(config=...): the script filled in the \"auto\" keys of "
                               f"{config_path}: optimizer.params.lr 5e-05, optimizer.params.betas [0.9, 0.999],")
    assert shown[0].endswith("fp16.enabled false, bf16.enabled false; zerorun trains with these.")
    assert shown[1] == ("zerorun: warning: --set optimizer.weight_decay=0.1 sets optimizer.weight_decay = 0.1, but the "
                        "DeepSpeed config the script passes to deepspeed.initialize (initialize(config=...)) says "
                        "optimizer.params.weight_decay = 0.0, which wins (as in DeepSpeed): optimizer.weight_decay is 0.0.")
    assert recipe.optimizer.lr == 5e-5 and recipe.train.clip_grad_norm == 1.0
    given["gradient_clipping"] = "auto"  # a script that passes "auto" on: refused, as DeepSpeed refuses it
    with pytest.raises(ConfigError, match=r"initialize\(config=...\): \"auto\" in 1 key\(s\) that nothing filled in"):
        recipe_for(given, launched, 2, 1)


def test_a_deepspeed_script_handed_the_trainers_auto_config_is_refused_naming_each_key_and_its_filler(
        tmp_path: Path) -> None:
    """A script calling deepspeed.initialize itself with the launched file (issue 57: 13 "auto"s trained on
    zerorun's defaults, learning rate included, in silence). A recipe key the user gives fills its "auto"."""
    from zerorun.compat.api import recipe_for

    config_path = Path(__file__).parent / "configs" / "hf_auto_stage2.json"
    (tmp_path / "r.yaml").write_text(f"script: t.py\ndeepspeed_config: {config_path}\nlaunch: {{deepspeed_compat: true}}\n")
    launched = config.load(tmp_path / "r.yaml", check_script=False)
    for source in (str(config_path), None, json.loads(config_path.read_text())):
        with pytest.raises(ConfigError) as err:
            recipe_for(source, launched, world_size=2)
        message = str(err.value)
        assert '"auto" in 13 key(s) that nothing filled in before deepspeed.initialize' in message, message
        assert "optimizer.params.lr: the Trainer fills it from --learning_rate; give a value, or --set optimizer.lr=" \
            in message and "\n  bf16.enabled: the Trainer fills it from --bf16;" in message
    rest = ["train.clip_grad_norm=1.0", "optimizer.betas=[0.9,0.99]", "optimizer.eps=1e-8",
            "optimizer.weight_decay=0.0", "scheduler.warmup_min_lr=0", "scheduler.warmup_max_lr=0.01",
            "scheduler.warmup_num_steps=1", "scheduler.total_num_steps=8", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.grad_accum_steps=1", "precision.dtype=fp32"]
    with pytest.raises(ConfigError, match=r"in 1 key\(s\).*\n  optimizer.params.lr: the Trainer"):
        recipe_for(str(config_path), config.load(tmp_path / "r.yaml", rest, check_script=False), world_size=2)
    given = config.load(tmp_path / "r.yaml", [*rest, "optimizer.lr=0.01"], check_script=False)
    recipe, _ = recipe_for(str(config_path), given, world_size=2)
    assert recipe.optimizer.lr == 0.01


def test_a_recipe_reads_a_deepspeed_config_and_its_own_keys_win(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                                  "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}))
    (tmp_path / "r.yaml").write_text("script: t.py\ndeepspeed_config: ds.json\nzero:\n  bucket_mb: 2\n"
                                     "precision: fp32\n")
    recipe = config.load(tmp_path / "r.yaml", ["train.grad_accum_steps=3"], check_script=False)
    assert recipe.deepspeed_config == str(tmp_path / "ds.json")
    assert (recipe.zero.stage, recipe.zero.bucket_mb, recipe.precision.dtype) == (1, 2.0, "fp32")
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum_steps) == (4, 3)


def test_a_bad_value_in_the_deepspeed_config_names_the_json_file_and_key(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                                                  "zero_optimization": {"stage": 2,
                                                                        "offload_param": {"device": "cpu"}}}))
    (tmp_path / "r.yaml").write_text("script: t.py\ndeepspeed_config: ds.json\n")
    with pytest.raises(ConfigError) as err:
        config.load(tmp_path / "r.yaml", check_script=False)
    assert f"{tmp_path / 'ds.json'}: zero_optimization.offload_param.device" in str(err.value)
    (tmp_path / "ds.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"ds.json:1: not valid JSON"):
        config.load(tmp_path / "r.yaml", check_script=False)
    (tmp_path / "r.yaml").write_text("script: t.py\ndeepspeed_config: missing.json\n")
    with pytest.raises(ConfigError, match=r"r.yaml:2: deepspeed_config: .*missing.json does not exist"):
        config.load(tmp_path / "r.yaml", check_script=False)


def test_global_batch_size_is_checked_against_the_world_size() -> None:
    recipe = config.loads("script: t.py\ntrain: {micro_batch_size: 2, grad_accum_steps: 3, global_batch_size: 12}\n")
    config.check_global_batch(recipe, 2)
    with pytest.raises(ConfigError, match=r"global_batch_size: 12 != micro_batch_size 2 x grad_accum_steps 3 x "
                                          r"world size 3 = 18"):
        config.check_global_batch(recipe, 3)


def test_zero_quantized_gradients_maps_to_qgz() -> None:
    t = ds_config.translate({"train_micro_batch_size_per_gpu": 1,
                             "zero_optimization": {"stage": 2, "zero_quantized_gradients": True}})
    assert t.data["zero"]["quantized_gradients"] is True and t.data["zero"]["stage"] == 2
    assert "zero_optimization.zero_quantized_gradients" not in _notes(t, Level.ERROR)


def test_grad_accum_dtype_is_the_reduce_dtype_and_fp16_is_refused_by_name() -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    t = ds_config.translate({**base, "data_types": {"grad_accum_dtype": "bf16"}})
    assert t.data["zero"]["reduce_dtype"] == "bf16" and not t.errors
    assert "reduce_dtype" not in ds_config.translate(base).data["zero"]  # unset: zerorun's fp32
    refused = _notes(ds_config.translate({**base, "data_types": {"grad_accum_dtype": "fp16"}}), Level.ERROR)
    assert "expected fp32 or bf16, got 'fp16'" in refused["data_types.grad_accum_dtype"]
    warned = _notes(ds_config.translate({**base, "communication_data_type": "bf16"}), Level.WARNING)
    assert "zero.reduce_dtype" in warned["communication_data_type"]


def test_deepspeeds_optimizer_types_become_the_recipes_with_their_parameters() -> None:
    """Lion, Adagrad, LAMB and Muon as DeepSpeed names them (any case), their params mapped; 1-bit optimizers and
    names no config builds are refused saying what to do; zero_allow_untested_optimizer has nothing to allow."""
    def optimizer(ds_optimizer: dict) -> tuple[dict, dict[str, str]]:
        t = ds_config.translate({"train_micro_batch_size_per_gpu": 2, "optimizer": ds_optimizer,
                                 "zero_allow_untested_optimizer": True})
        return t.data.get("optimizer", {}), {n.key: n.message for n in t.notes if n.level is Level.ERROR}
    lion, errors = optimizer({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1}})
    assert lion == {"type": "lion", "lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1} and not errors
    adagrad, _ = optimizer({"type": "Adagrad", "params": {"lr": 1e-2}})
    assert adagrad == {"type": "adagrad", "lr": 1e-2, "weight_decay": 0.0}  # DeepSpeed's default decay: none
    lamb, errors = optimizer({"type": "LAMB", "params": {"lr": 1e-3, "max_coeff": 0.3}})
    assert lamb["type"] == "lamb" and "zerorun.Lamb(params, max_coeff=...)" in errors["optimizer.params.max_coeff"]
    muon, _ = optimizer({"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 2e-2, "momentum": 0.9}})
    assert (muon["type"], muon["lr"], muon["adam_lr"], muon["momentum"]) == ("muon", 2e-2, 1e-3, 0.9)
    _, errors = optimizer({"type": "OneBitAdam", "params": {"lr": 1e-3}})
    assert "zero.quantized_gradients" in errors["optimizer.type"]
    _, errors = optimizer({"type": "Novograd", "params": {"lr": 1e-3}})
    assert "deepspeed.initialize(optimizer=...)" in errors["optimizer.type"]
