from typing import Any

import pytest

from distrun.config import JobSpec, RecipeKind, StrategyName, inspect_recipe
from distrun.errors import ConfigError, RecipeError


def spec(**kw) -> JobSpec:
    base: dict[str, Any] = dict(recipe="/r.py", strategy=StrategyName.MIRRORED, replicas=2, global_batch_size=8)
    base.update(kw)
    return JobSpec.of(**base)


def test_round_trips_through_json():
    s = spec(steps=5, recipe_args=("--a", "1"), checkpoint_dir="/c", resume=True)
    assert JobSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(global_batch_size=10, replicas=4), "--global-batch-size 10 is not divisible by 4 replicas"),
        (dict(strategy=StrategyName.ONE_DEVICE, replicas=2), "one-device runs one replica"),
        (dict(steps=3, epochs=1), "--steps and --epochs are exclusive"),
        (dict(resume=True), "--resume needs --checkpoint-dir"),
        (dict(replicas=0), "--replicas: expected a positive whole number. Received: 0"),
        (dict(recipe="relative.py"), "must be absolute"),
    ],
)
def test_rejects_bad_specs_with_the_flag_named(kw, fragment):
    with pytest.raises(ConfigError) as err:
        spec(**kw)
    assert fragment in err.value.message


def test_unknown_strategy_suggests_the_closest():
    with pytest.raises(ConfigError) as err:
        StrategyName.parse("mirored")
    assert "did you mean 'mirrored'" in err.value.message


def test_from_json_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown keys"):
        JobSpec.from_json('{"recipe": "/r.py", "bogus": 1}')


def test_classifies_the_three_recipe_levels(write_recipe):
    fit = write_recipe(
        "def model(): pass\ndef optimizer(p): pass\ndef loss(o, b): pass\ndef train_data(ctx): pass\n"
        "defaults = {'global_batch_size': 16, 'epochs': 2}\n", "fit.py")
    custom = write_recipe("def main(strategy):\n    pass\n", "custom.py")
    script = write_recipe("def main():\n    pass\nif __name__ == '__main__':\n    main()\n", "script.py")
    info = inspect_recipe(str(fit))
    assert info.kind is RecipeKind.FIT and dict(info.defaults) == {"global_batch_size": 16, "epochs": 2}
    assert inspect_recipe(str(custom)).kind is RecipeKind.CUSTOM_LOOP
    assert inspect_recipe(str(script)).kind is RecipeKind.SCRIPT


def test_partial_fit_recipe_names_what_is_missing(write_recipe):
    path = write_recipe("import torch\n\ndef model():\n    pass\n\ndef loss(o, b):\n    pass\n")
    with pytest.raises(RecipeError) as err:
        inspect_recipe(str(path))
    msg = err.value.message
    assert msg.startswith(f"{path}:3:")
    assert "optimizer(params)" in msg and "train_data(ctx)" in msg


def test_syntax_error_names_file_and_line(write_recipe):
    path = write_recipe("x = 1\ndef model(:\n    pass\n")
    with pytest.raises(RecipeError) as err:
        inspect_recipe(str(path))
    assert err.value.message.startswith(f"{path}:2: syntax error")


@pytest.mark.parametrize(
    "defaults, fragment",
    [
        ("{'global_batchsize': 4}", "did you mean 'global_batch_size'"),
        ("{'epochs': 0}", "must be a positive whole number"),
        ("dict(epochs=2)", "must be a literal dict"),
    ],
)
def test_bad_defaults_are_recipe_errors(write_recipe, defaults, fragment):
    path = write_recipe(f"def main(strategy): pass\ndefaults = {defaults}\n")
    with pytest.raises(RecipeError) as err:
        inspect_recipe(str(path))
    assert fragment in err.value.message and f"{path}:2" in err.value.message
