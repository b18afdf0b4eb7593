"""DFLASH_EXCLUDED_GPUS: the bus-id mapping with stubbed device properties (no GPU here), and a run that
lost a drafter resuming from the checkpoint of the larger layout (the real tiny target on CPU)."""

from __future__ import annotations

import dataclasses
import logging
import types
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.config import ConfigError, RunConfig
from dflash.errors import EXIT_FAILED
from dflash.train.devices import (
    EXCLUDED_ENV,
    BusId,
    NoDevicesLeft,
    bus_id_of,
    exclude,
    excluded_from_env,
    parse_bus_id,
)
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

pytestmark = pytest.mark.timeout(240)

# cuda:N -> bus 0xb0 + N on domain 0 (torch 2.x: integers); cuda:9's build gives a string
BUSES = {i: 0xB0 + i for i in range(8)}


def props(index: int) -> t.Any:
    if index == 9:
        return types.SimpleNamespace(pci_bus_id="00000000:C1:00.0")
    if index not in BUSES:
        raise AssertionError(f"Invalid device id {index}")  # what torch raises past the devices there
    return types.SimpleNamespace(pci_domain_id=0, pci_bus_id=BUSES[index], pci_device_id=0)


def config(targets: tuple[str, ...], drafters: tuple[str, ...], tmp_path: Path) -> RunConfig:
    cfg = tiny_config(tmp_path)
    return dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, targets=targets, drafters=drafters))


def test_bus_ids_parse_in_every_form_the_driver_and_nvidia_smi_write() -> None:
    full = parse_bus_id("0000:b3:00.0")
    assert full == BusId(bus=0xB3, device=0, domain=0, function=0) and str(full) == "0000:b3:00.0"
    for form in ("00000000:B3:00.0", "0000:b3:00", "b3:00", " B3:00.0 "):
        assert parse_bus_id(form).matches(full), form
    assert not parse_bus_id("b4:00").matches(full)
    assert not parse_bus_id("0001:b3:00.0").matches(full)
    for bad in ("b3", "gpu3", "0000:b3:00.9", "cuda:0", "0000:b3:000.0"):
        with pytest.raises(ValueError):
            parse_bus_id(bad)


def test_the_variable_is_read_once_and_a_malformed_id_is_named() -> None:
    assert excluded_from_env({}) == ()
    assert excluded_from_env({EXCLUDED_ENV: " 0000:b3:00.0, ,b4:00"}) == (
        BusId(bus=0xB3, device=0, domain=0, function=0),
        BusId(bus=0xB4, device=0),
    )
    with pytest.raises(ConfigError) as e:
        excluded_from_env({EXCLUDED_ENV: "0000:b3:00.0,gpu5"})
    assert str(e.value) == f"${EXCLUDED_ENV}: 'gpu5' is not a PCI bus id (expected e.g. 0000:b3:00.0 or b3:00)"


def test_bus_id_of_reads_torch_integers_or_a_string_and_none_without_them() -> None:
    assert bus_id_of(props(3)) == BusId(bus=0xB3, device=0, domain=0, function=0)
    assert bus_id_of(props(9)) == BusId(bus=0xC1, device=0, domain=0, function=0)
    assert bus_id_of(types.SimpleNamespace(name="old build")) is None


def test_exclude_drops_the_named_gpus_and_says_the_layout_before_and_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(("cuda:0", "cuda:1", "cuda:2", "cuda:3"), ("cuda:4", "cuda:5", "cuda:9"), tmp_path)
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        out = exclude(cfg, {EXCLUDED_ENV: "0000:b1:00.0,c1:00"}, properties=props)
    assert out.devices.targets == ("cuda:0", "cuda:2", "cuda:3")
    assert out.devices.drafters == ("cuda:4", "cuda:5")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("devices:")]
    assert line == (
        f"devices: {EXCLUDED_ENV}=0000:b1:00.0,c1:00: "
        "4 targets ['cuda:0', 'cuda:1', 'cuda:2', 'cuda:3'] + 3 drafters ['cuda:4', 'cuda:5', 'cuda:9'] -> "
        "3 targets ['cuda:0', 'cuda:2', 'cuda:3'] + 2 drafters ['cuda:4', 'cuda:5'] "
        "(excluded cuda:1 (0000:b1:00.0), cuda:9 (0000:c1:00.0))"
    )
    assert exclude(cfg, {}, properties=props) is cfg  # unset: nothing to say, nothing changed


def test_cpu_and_unknown_devices_are_never_excluded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(("cpu", "cuda:7"), ("cpu", "cuda:8"), tmp_path)  # cuda:8: past the devices (check_devices says it)
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        out = exclude(cfg, {EXCLUDED_ENV: "00:00,b8:00"}, properties=props)
    assert out.devices == cfg.devices
    assert any("none of the run's devices is on those buses" in r.getMessage() for r in caplog.records)


def test_a_board_off_the_bus_is_dropped_and_the_boards_after_it_renumbered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight boards b0..b7; b3 fell off the bus (Xid 79), so torch enumerates seven and the config's cuda:4 is
    the board torch now calls cuda:3: read against the box's old numbering, nothing lands on the wrong GPU."""
    there = [0xB0, 0xB1, 0xB2, 0xB4, 0xB5, 0xB6, 0xB7]

    def props_now(index: int) -> t.Any:
        if index >= len(there):
            raise AssertionError(f"Invalid device id {index}")
        return types.SimpleNamespace(pci_domain_id=0, pci_bus_id=there[index], pci_device_id=0)

    cfg = config(tuple(f"cuda:{i}" for i in range(5)), ("cuda:5", "cuda:6", "cuda:7"), tmp_path)
    env = {EXCLUDED_ENV: "0000:b3:00"}
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        out = exclude(cfg, env, properties=props_now, count=lambda: len(there))
    assert out.devices.targets == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert out.devices.drafters == ("cuda:4", "cuda:5", "cuda:6")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("devices:")]
    assert "cuda:4 is now cuda:3; cuda:5 is now cuda:4; cuda:6 is now cuda:5; cuda:7 is now cuda:6" in line
    assert line.endswith("(excluded cuda:3 (0000:b3:00: off the bus))")
    # where the old numbering cannot be known, the indices stay and a warning says why
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        kept = exclude(cfg, {**env, "CUDA_VISIBLE_DEVICES": "0,1,2,4,5,6,7"}, properties=props_now, count=lambda: 7)
    assert kept.devices == cfg.devices
    assert any(
        "CUDA_VISIBLE_DEVICES is set: the config's cuda:N are taken as they are" in r.getMessage()
        for r in caplog.records
    )


def test_no_drafter_left_is_one_line_and_exit_1(tmp_path: Path) -> None:
    cfg = config(("cuda:0", "cuda:1"), ("cuda:2",), tmp_path)
    with pytest.raises(NoDevicesLeft) as e:
        exclude(cfg, {EXCLUDED_ENV: "0000:b2:00.0"}, properties=props)
    assert e.value.exit_code == EXIT_FAILED and not e.value.traceback
    assert "\n" not in e.value.line()
    assert e.value.line().startswith(f"dflash: {EXCLUDED_ENV}=0000:b2:00.0 leaves no drafter device of 2 targets")
    # the supervisor reads this line as the trainer's verdict: no restart, a give-up (ops/supervise/policy.py)
    from ops.diagnosis import diagnose, no_devices_left

    said = diagnose(["INFO dflash.train: starting", e.value.line()], exit_code=EXIT_FAILED, signal=None)
    assert said.cause == "nonzero-exit" and no_devices_left(said.detail, EXIT_FAILED)
    with pytest.raises(NoDevicesLeft, match="leaves no target device"):
        exclude(cfg, {EXCLUDED_ENV: "b0:00,b1:00"}, properties=props)


def test_a_malformed_variable_stops_the_run_before_the_models_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'b3' is not a PCI bus id"):
        Run(tiny_config(tmp_path), environ={EXCLUDED_ENV: "b3"})
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def default_spu(cfg: RunConfig) -> RunConfig:
    """The tiny config without its sequences_per_update (the default: 32 over the drafters)."""
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, sequences_per_update=None))


def test_a_run_that_lost_a_drafter_resumes_the_larger_layouts_checkpoint(tmp_path: Path) -> None:
    first = Run(default_spu(tiny_config(tmp_path, "max_steps=2", "log_every=1")), environ={})
    assert (first.cfg.optim.sequences_per_update, first.accumulate) == (16, 4)  # ceil(32 / 2) in batches of 4
    assert first.train() == 0
    saved = ckpt.load_checkpoint(ckpt.latest_complete(tmp_path / "ckpt"))
    assert (saved.step, saved.trainer_state["drafters"]) == (2, 2)
    weights = {k: v.clone() for k, v in saved.state_dict.items()}

    # the other drafter excluded (on CPU no device has a bus id: the layout is the smaller one itself)
    env = {EXCLUDED_ENV: "0000:b3:00.0"}
    second = Run(default_spu(tiny_config(tmp_path, "max_steps=4", "log_every=1", "devices.drafters=cpu")), environ=env)
    assert len(second.drafters) == 1 and second.start_step == 2
    # the update keeps its size: 16 sequences, not ceil(32 / 1); the lr schedule and the step count with it
    assert (second.cfg.optim.sequences_per_update, second.accumulate) == (16, 4)
    assert second.shard_starts == saved.trainer_state["data"]["next"]
    for k, v in second.drafters[0].model.state_dict().items():
        assert torch.equal(v, weights[k]), f"the one drafter resumed with the averaged {k}"
    assert second.train() == 0
    assert ckpt.latest_complete(tmp_path / "ckpt").name == "step-4"
    before = first.drafters[0].trained + first.drafters[1].trained
    after = second.drafters[0].trained
    assert len(after) == 2 * 4, "two updates of four batches"
    assert not set(before) & set(after), "no batch trained twice across the restart"
