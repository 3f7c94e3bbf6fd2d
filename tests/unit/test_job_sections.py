"""JobSpec's sections: they match the job file's, flat names build and change a spec, and the
JSON form is nested."""

from __future__ import annotations

import dataclasses
import json

import pytest

from distrun.config import JobSpec, StrategyName
from distrun.config._sections import FLAT_FIELDS, SECTION_TYPES, CheckpointSection, TrainingSection
from distrun.config.job_file import SECTIONS
from distrun.errors import ConfigError

#: File keys whose JobSpec attributes are named otherwise (config/_sections.py says why), and the
#: one a job never holds (the client's hang timeout).
_RENAMED = {("strategy", "elastic"): ("elastic_min", "elastic_max"), ("checkpoint", "async"): ("asynchronous",),
            ("observe", "tensorboard"): ("tensorboard_dir",), ("observe", "profile"): ("profile_steps", "profile_dir"),
            ("observe", "tracker"): ("trackers",), ("observe", "tracker_uri"): ("tracker_uris",),
            ("observe", "hang_timeout_s"): ()}


def test_the_sections_are_the_job_files():
    assert list(SECTION_TYPES) == [s.name for s in SECTIONS if s.name != "cluster"]  # cluster: where, not what
    assert [f.name for f in dataclasses.fields(JobSpec)] == ["recipe", *SECTION_TYPES, "extra_env", "preemptible"]
    for section in SECTIONS:
        if section.name == "cluster":
            continue
        attributes = [attr for key in section.keys for attr in _RENAMED.get((section.name, key), (key,))]
        assert attributes == [f.name for f in dataclasses.fields(SECTION_TYPES[section.name])], section.name
        for key, param in section.keys.items():  # a train parameter named as a flat field lands on its key's attribute
            if param in FLAT_FIELDS:
                assert FLAT_FIELDS[param] == (section.name, _RENAMED.get((section.name, key), (key,))[0])


def test_every_section_attribute_has_one_flat_name():
    places = sorted(FLAT_FIELDS.values())
    assert places == sorted((name, f.name) for name, kind in SECTION_TYPES.items() for f in dataclasses.fields(kind))


def test_flat_names_build_and_change_a_spec():
    spec = JobSpec.of("/r.py", strategy=StrategyName.MIRRORED, replicas=2, steps=5, recipe_args=("--a",),
                      checkpoint_dir="/c", async_checkpoint=False, precision="bf16", preemptible=True)
    assert spec.strategy.name is StrategyName.MIRRORED and spec.strategy.replicas == 2
    assert spec.training == TrainingSection(steps=5, args=("--a",))
    assert spec.checkpoint == CheckpointSection(dir="/c") and spec.precision.name == "bf16" and spec.preemptible
    assert JobSpec.of("/r.py") == JobSpec(recipe="/r.py")  # every default as it was
    resumed = spec.replace(resume=True, keep_checkpoints=5, recipe="/s.py")
    assert (resumed.checkpoint.resume, resumed.checkpoint.keep, resumed.recipe) == (True, 5, "/s.py")
    assert not spec.checkpoint.resume and resumed.training is spec.training  # a new value; untouched sections shared
    with pytest.raises(ConfigError, match="--resume needs --checkpoint-dir"):
        spec.replace(checkpoint_dir=None, resume=True)  # validated again, as a whole
    with pytest.raises(TypeError, match="unexpected keyword argument 'stpes'"):
        JobSpec.of("/r.py", stpes=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'training'"):
        spec.replace(training=TrainingSection())  # flat names only


def test_the_json_form_is_nested_and_refuses_unknown_keys_at_both_levels():
    spec = JobSpec.of("/r.py", strategy=StrategyName.SHARDED, replicas=2, steps=4, profile_steps=(1, 2),
                      trackers=("mlflow",), tracker_uris={"mlflow": "sqlite:///m.db"}, extra_env={"A": "1"})
    data = json.loads(spec.to_json())
    assert data["strategy"]["name"] == "sharded" and data["training"]["steps"] == 4 and data["extra_env"] == {"A": "1"}
    assert data["observe"]["profile_steps"] == [1, 2] and "steps" not in data
    assert JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError) as caught:
        JobSpec.from_json('{"recipe": "/r.py", "training": {"steps": 3, "bogus": 1}}')
    assert caught.value.message == "job spec: unknown keys ['training.bogus'] (client and worker versions differ?)"
    with pytest.raises(ConfigError, match=r"unknown keys \['steps'\]"):  # the flat form of an older client
        JobSpec.from_json('{"recipe": "/r.py", "steps": 3}')
    with pytest.raises(ConfigError, match="job spec: strategy: expected an object of its keys"):
        JobSpec.from_json('{"recipe": "/r.py", "strategy": "mirrored"}')
