"""``offload.overlap``: which order the transitions take, and why (``ppo_driver.overlap``)."""

from __future__ import annotations

import pytest

from ppo_driver.config import ConfigError, load_config
from ppo_driver.overlap import choose_overlap

GB = 1e9
H200 = 143.8 * GB


def _gpu(free_gb: float, total: float = H200) -> dict[str, float]:
    return {"device_free": free_gb * GB, "device_total": total, "allocated": 1.0}


def test_auto_overlaps_when_every_trainer_gpu_keeps_the_headroom() -> None:
    choice = choose_overlap(
        "auto", device="cuda", offload=True, memory=[_gpu(120), _gpu(100)], headroom_gb=None
    )
    assert choice.overlap
    assert "100.0 GB free" in choice.reason  # the least free GPU is named
    assert choice.describe().startswith("transitions: overlapped (offload.overlap=auto")


def test_auto_is_sequential_when_one_gpu_is_short_of_the_headroom() -> None:
    # Half of an H200 (71.9 GB) is the default headroom: one rank with 60 GB free is short.
    choice = choose_overlap(
        "auto", device="cuda", offload=True, memory=[_gpu(120), _gpu(60)], headroom_gb=None
    )
    assert not choice.overlap
    assert "60.0 GB free < 71.9 GB" in choice.reason
    assert "offload.overlap_headroom_gb" in choice.reason
    # An explicit headroom decides instead of the default share.
    short = choose_overlap("auto", device="cuda", offload=True, memory=[_gpu(120)], headroom_gb=130.0)
    assert not short.overlap
    assert "120.0 GB free < 130.0 GB" in short.reason
    enough = choose_overlap("auto", device="cuda", offload=True, memory=[_gpu(60)], headroom_gb=50.0)
    assert enough.overlap


def test_auto_without_readings_or_on_cpu_is_sequential() -> None:
    unknown = choose_overlap("auto", device="cuda", offload=True, memory=[_gpu(120), {}], headroom_gb=None)
    assert not unknown.overlap
    assert "reported no device memory" in unknown.reason
    assert not choose_overlap("auto", device="cuda", offload=True, memory=[], headroom_gb=None).overlap
    cpu = choose_overlap("auto", device="cpu", offload=True, memory=[], headroom_gb=None)
    assert not cpu.overlap
    assert "placement.device=cpu" in cpu.reason


@pytest.mark.parametrize(
    ("mode", "offload", "expected", "words"),
    [
        ("on", True, True, "memory not checked"),
        ("off", True, False, "offload.overlap=off"),
        ("on", False, False, "nothing moves"),  # nothing to overlap without offload
    ],
)
def test_on_and_off_are_taken_as_they_are(mode: str, offload: bool, expected: bool, words: str) -> None:
    choice = choose_overlap(mode, device="cuda", offload=offload, memory=[_gpu(1)], headroom_gb=None)  # type: ignore[arg-type]
    assert choice.overlap is expected
    assert words in choice.reason


def test_config_takes_yaml_on_off_and_refuses_other_words() -> None:
    assert load_config(None, ["offload.overlap=on"]).offload.overlap == "on"
    assert load_config(None, ["offload.overlap=off"]).offload.overlap == "off"
    assert load_config(None, []).offload.overlap == "auto"
    with pytest.raises(ConfigError, match=r"offload\.overlap"):
        load_config(None, ["offload.overlap=sometimes"])
    with pytest.raises(ConfigError, match="overlap_headroom_gb"):
        load_config(None, ["offload.overlap_headroom_gb=0"])
