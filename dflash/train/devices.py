"""The GPUs a run leaves out: ``DFLASH_EXCLUDED_GPUS`` read against the PCI bus id of every device.

A supervisor that saw a GPU fail in hardware restarts the run with that GPU's bus id in
``DFLASH_EXCLUDED_GPUS`` (comma-separated, as the driver writes them: ``0000:b3:00.0``; the Xid line's
``0000:b3:00`` and a short ``b3:00`` match too). Bus ids, not ``cuda:N`` indices: an index moves with
``CUDA_VISIBLE_DEVICES`` and with a GPU that left the bus, a bus id names the board. ``exclude`` maps every
device of ``devices.targets`` / ``devices.drafters`` to its bus id (torch's device properties), drops the
excluded ones and says the layout before and after in one line; ``cpu`` has no bus id and is never dropped.
No target or no drafter left: ``NoDevicesLeft`` (one line, exit 1), before anything loads.

A GPU that fell off the bus (Xid 79) is not enumerated any more, so every ``cuda:N`` after it names the next
board. When an excluded bus id is missing from the devices there, the config's indices are read against the
enumeration the box had with it: the devices there plus the missing ones, in PCI bus order (the order CUDA
and nvidia-smi number identical boards in); the missing board is dropped and the others renumbered, said in
the same line. Only where that order can be known: the devices there in increasing bus order, every bus id
readable and ``CUDA_VISIBLE_DEVICES`` unset (else the indices are kept as they are, and a warning says so).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import typing as t

from dflash.config import ConfigError, RunConfig
from dflash.errors import Failed

EXCLUDED_ENV = "DFLASH_EXCLUDED_GPUS"

logger = logging.getLogger("dflash.train")  # the run's start lines share one logger name

# [domain:]bus:device[.function], hex: the driver's 0000:b3:00.0, nvidia-smi's 00000000:B3:00.0, the Xid line's
# 0000:b3:00, a short b3:00
_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})(?:\.(?P<function>[0-7]))?$",
    re.IGNORECASE,
)


class NoDevicesLeft(Failed):
    """Every target or every drafter device is excluded: the run cannot start (exit 1, one line)."""


@dataclasses.dataclass(frozen=True, slots=True)
class BusId:
    """A PCI address; a part left out (domain, function) matches any."""

    bus: int
    device: int
    domain: int | None = None
    function: int | None = None

    def matches(self, other: BusId) -> bool:
        if (self.bus, self.device) != (other.bus, other.device):
            return False
        return all(
            a is None or b is None or a == b for a, b in ((self.domain, other.domain), (self.function, other.function))
        )

    def __str__(self) -> str:
        head = f"{self.domain:04x}:" if self.domain is not None else ""
        tail = f".{self.function:x}" if self.function is not None else ""
        return f"{head}{self.bus:02x}:{self.device:02x}{tail}"


def parse_bus_id(text: str) -> BusId:
    """``0000:b3:00.0`` (or a shorter form) -> BusId; ValueError for anything else."""
    m = _BUS_ID.match(text.strip())
    if m is None:
        raise ValueError(text)
    domain, function = m.group("domain"), m.group("function")
    return BusId(
        bus=int(m.group("bus"), 16),
        device=int(m.group("device"), 16),
        domain=None if domain is None else int(domain, 16),
        function=None if function is None else int(function),
    )


def excluded_from_env(environ: t.Mapping[str, str]) -> tuple[BusId, ...]:
    """The bus ids ``DFLASH_EXCLUDED_GPUS`` names (empty items ignored); a malformed one is a ConfigError."""
    out = []
    for item in environ.get(EXCLUDED_ENV, "").split(","):
        if not item.strip():
            continue
        try:
            out.append(parse_bus_id(item))
        except ValueError:
            raise ConfigError(
                f"${EXCLUDED_ENV}", f"{item.strip()!r} is not a PCI bus id (expected e.g. 0000:b3:00.0 or b3:00)"
            ) from None
    return tuple(out)


def bus_id_of(props: t.Any) -> BusId | None:
    """The bus id in a CUDA device's properties (``torch.cuda.get_device_properties``): a ``pci_bus_id``
    string where a build gives one, else torch's integers (pci_domain_id, pci_bus_id, pci_device_id: torch
    2.x); None when they are missing. The function is 0: a GPU is function 0 of its PCI device."""
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, str):
        try:
            return parse_bus_id(bus)
        except ValueError:
            return None
    domain, device = getattr(props, "pci_domain_id", None), getattr(props, "pci_device_id", None)
    if not all(isinstance(v, int) for v in (bus, domain, device)):
        return None
    return BusId(bus=t.cast(int, bus), device=t.cast(int, device), domain=t.cast(int, domain), function=0)


def torch_properties(index: int) -> t.Any:
    import torch

    return torch.cuda.get_device_properties(index)


def torch_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _order(bus: BusId) -> tuple[int, int, int]:
    return (bus.domain or 0, bus.bus, bus.device)


def renumbering(
    excluded: t.Sequence[BusId],
    environ: t.Mapping[str, str],
    count: t.Callable[[], int],
    properties: t.Callable[[int], t.Any],
) -> dict[int, tuple[BusId, int | None]]:
    """Config index -> (its board, the board's index there; None: it left the bus), when an excluded board is
    missing from the devices there; empty when none is, or when the old order cannot be known (a warning says
    why)."""
    present = [bus_id_of(properties(i)) for i in range(count())]
    missing = [x for x in excluded if not any(p is not None and x.matches(p) for p in present)]
    if not missing or not present:
        return {}
    why = None
    if environ.get("CUDA_VISIBLE_DEVICES"):
        why = "CUDA_VISIBLE_DEVICES is set"
    elif any(p is None for p in present):
        why = "a device there has no readable bus id"
    elif any(_order(t.cast(BusId, a)) >= _order(t.cast(BusId, b)) for a, b in zip(present, present[1:])):
        why = "the devices there are not numbered in bus order"
    if why is not None:
        logger.warning(
            "devices: %s names %s, not among the devices there, but %s: the config's cuda:N are taken as they are",
            EXCLUDED_ENV,
            ", ".join(str(x) for x in missing),
            why,
        )
        return {}
    boards = sorted([*t.cast(list[BusId], present), *missing], key=_order)
    return {i: (b, None if b in missing else present.index(b)) for i, b in enumerate(boards)}


def device_bus_id(device: str, properties: t.Callable[[int], t.Any]) -> BusId | None:
    """``cuda:N`` -> its bus id (None when unknown); ``cpu`` has none."""
    if not device.startswith("cuda:"):
        return None
    try:
        return bus_id_of(properties(int(device.split(":")[1])))
    except (RuntimeError, AssertionError, ValueError):  # an index past the devices there: check_devices says it
        return None


def exclude(
    cfg: RunConfig,
    environ: t.Mapping[str, str],
    *,
    properties: t.Callable[[int], t.Any] = torch_properties,
    count: t.Callable[[], int] = torch_count,
) -> RunConfig:
    """``cfg`` without the devices whose bus id ``DFLASH_EXCLUDED_GPUS`` names, said in one line (nothing
    said when the variable is unset or empty). ``properties``: a CUDA index's device properties, ``count``:
    how many there are (tests stub both)."""
    excluded = excluded_from_env(environ)
    if not excluded:
        return cfg
    moved = renumbering(excluded, environ, count, properties)
    kept: dict[str, tuple[str, ...]] = {}
    dropped: list[str] = []
    renamed: list[str] = []
    for role in ("targets", "drafters"):
        keep = []
        for dev in getattr(cfg.devices, role):
            index = int(dev.split(":")[1]) if dev.startswith("cuda:") and dev.split(":")[1].isdigit() else None
            if index is not None and index in moved:
                board, now = moved[index]
                if now is None:
                    dropped.append(f"{dev} ({board}: off the bus)")
                    continue
                if now != index:
                    renamed.append(f"{dev} is now cuda:{now}")
                    dev = f"cuda:{now}"
            bus = device_bus_id(dev, properties)
            if bus is not None and any(x.matches(bus) for x in excluded):
                dropped.append(f"{dev} ({bus})")
            else:
                keep.append(dev)
        kept[role] = tuple(keep)
    before = f"{len(cfg.devices.targets)} targets {list(cfg.devices.targets)} + {len(cfg.devices.drafters)} drafters {list(cfg.devices.drafters)}"
    after = f"{len(kept['targets'])} targets {list(kept['targets'])} + {len(kept['drafters'])} drafters {list(kept['drafters'])}"
    names = ",".join(str(x) for x in excluded)
    if renamed:
        after += f" ({'; '.join(renamed)}: a board left the bus)"
    for role in ("targets", "drafters"):
        if not kept[role]:
            raise NoDevicesLeft(
                f"dflash: {EXCLUDED_ENV}={names} leaves no {role[:-1]} device of {before} "
                f"(excluded: {', '.join(dropped)}); the run cannot start"
            )
    logger.info(
        "devices: %s=%s: %s -> %s (%s)",
        EXCLUDED_ENV,
        names,
        before,
        after,
        f"excluded {', '.join(dropped)}" if dropped else "none of the run's devices is on those buses",
    )
    return dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, **kept))


__all__ = [
    "EXCLUDED_ENV",
    "BusId",
    "NoDevicesLeft",
    "bus_id_of",
    "device_bus_id",
    "exclude",
    "excluded_from_env",
    "parse_bus_id",
    "renumbering",
]
