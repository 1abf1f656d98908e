"""What a step asks for: whole TPU slices, or (fractions of) accelerators by Ray resource name.

The requests are built on the Airflow side, often at DAG parse time, and travel to the
cluster-side launcher as JSON, so this module is pure pydantic: importing it must not
pull in ray, jax or airflow. The TPU facts below are copied from Ray's own tables
(``ray/_private/accelerators/tpu.py``) rather than imported, for the same reason.

Every invalid request raises :class:`~rayslice.core.exceptions.InvalidRequestError` at
construction, with a message that says what was wrong and what would be valid.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from itertools import product
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rayslice.core.exceptions import InvalidRequestError


def _grid_3d(*maxima: int) -> set[str]:
    """Ray's large 3D topologies: every dimension a multiple of 4 up to its maximum."""
    return {"x".join(map(str, dims)) for dims in product(*(range(4, m + 1, 4) for m in maxima))}


_SMALL_3D = {"2x2x1", "2x2x2", "2x2x4", "2x4x4"}
_LITE_2D = {"1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16"}

#: Valid topologies per TPU version. Same as Ray's table, plus "2x2" for v2/v3: the
#: single-host v2-8/v3-8 exist on GCP but Ray's table only lists their pod topologies.
TPU_TOPOLOGIES: dict[str, frozenset[str]] = {
    "v2": frozenset({"2x2", "4x4", "4x8", "8x8", "8x16", "16x16"}),
    "v3": frozenset({"2x2", "4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32"}),
    "v4": frozenset(_SMALL_3D | _grid_3d(12, 12, 16)),
    "v5p": frozenset(_SMALL_3D | _grid_3d(16, 16, 24)),
    "v5litepod": frozenset(_LITE_2D),
    "v6e": frozenset(_LITE_2D),
    "v7x": frozenset(
        {"2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"}
    ),
}
# Lite versions name slices by chips (others by TensorCores, 2 per chip) and put single-host
# topologies on one VM of up to 8 chips (others always have 4 chips per host).
_LITE = ("v5litepod", "v6e")
_SINGLE_HOST_TOPOLOGIES = ("1x1", "2x2", "2x4")
_VERSION_ALIASES = {"v5e": "v5litepod"}
_CHIPS_PER_HOST_OPTIONS = (1, 2, 4, 8)  # Ray's TPU_VALID_CHIP_OPTIONS
#: JAX devices per chip where it is not one: a TPU7x (Ironwood) chip has two TensorCores and JAX
#: shows each as a device of its own (Ray: "some generations expose 2 logical XLA devices per chip
#: (e.g. v7x)", the reason for its RAY_TPU_RESOURCE_PER_CHIP); earlier two-core chips (v4, v5p)
#: show one device (megacore). docs/concepts.md cites the sources.
_DEVICES_PER_CHIP = {"v7x": 2}
#: Hosts along each axis of a topology, where Ray's SubslicePlacementGroup can take part of a slice
#: (Ray's `_VALID_TOPOLOGY_WORKER_DIMS_2D/3D`; larger v4/v5p/v7x 3D topologies: x/2, y/2, z). Ray
#: leaves out v3's 16x32 and 32x32 and v5e's 2x8: no subslices of those.
_SUBSLICE_HOSTS_2D = {"2x2": (1, 1), "2x4": (1, 2), "4x4": (2, 2), "4x8": (2, 4), "8x8": (4, 4), "8x16": (4, 8),
                      "16x16": (8, 8)}
_SUBSLICE_HOSTS_3D = {"2x2x1": (1, 1, 1), "2x2x2": (1, 1, 2), "2x2x4": (1, 1, 4), "2x4x4": (1, 2, 4),
                      "4x4x4": (2, 2, 4), "4x4x8": (2, 2, 8), "4x8x8": (2, 4, 8), "8x8x8": (4, 4, 8),
                      "8x8x16": (4, 4, 16), "8x16x16": (4, 8, 16), "16x16x16": (8, 8, 16), "16x16x24": (8, 8, 24)}


def _subslice_hosts(topology: str) -> tuple[int, ...] | None:
    """Hosts per axis of `topology` as Ray's subslices count them; None where Ray cannot subslice it."""
    dims = _dims(topology)
    if len(dims) == 2:
        return _SUBSLICE_HOSTS_2D.get(topology)
    if topology in _SUBSLICE_HOSTS_3D:
        return _SUBSLICE_HOSTS_3D[topology]
    return (dims[0] // 2, dims[1] // 2, dims[2]) if dims[0] % 2 == 0 and dims[1] % 2 == 0 else None


def subslices_of(version: str, topology: str) -> list[str]:
    """The subslice topologies a slice of `version` and `topology` can be cut into, smallest first.

    A subslice keeps its parent's hosts (4 chips each): v6e-16's "2x4" is 2 of its 4 hosts.
    """
    parent = _subslice_hosts(topology)
    if parent is None or math.prod(parent) < 2:
        return []
    out = [t for t in TPU_TOPOLOGIES[version]
           if t != topology and (hosts := _subslice_hosts(t)) is not None and len(hosts) == len(parent)
           and all(h <= p for h, p in zip(hosts, parent, strict=True)) and _chips(t) < _chips(topology)]
    return sorted(out, key=lambda t: (_chips(t), _dims(t)))
_NAME_RE = re.compile(r"^(v\d+[a-z]*)(?:-(\d+))?$")


def _dims(topology: str) -> tuple[int, ...]:
    return tuple(int(d) for d in topology.split("x"))


def _chips(topology: str) -> int:
    return math.prod(_dims(topology))


def _cores_per_chip(version: str) -> int:
    return 1 if version in _LITE else 2


def _default_topology(version: str, chips: int) -> str:
    """The squarest valid topology with that many chips (v6e-16 -> 4x4, not 2x8)."""
    fits = [t for t in TPU_TOPOLOGIES[version] if _chips(t) == chips]
    return min(fits, key=lambda t: (max(_dims(t)), _dims(t)))


def _default_chips_per_host(version: str, topology: str) -> int:
    """Ray's get_chips_per_host: small v5e/v6e slices sit on one VM, else 4 chips a host."""
    if version in _LITE and topology in _SINGLE_HOST_TOPOLOGIES:
        return _chips(topology)
    return 4


def _or_list(items: Iterable[object], limit: int = 10) -> str:
    words = [str(i) for i in items]
    if len(words) > limit:
        words = [*words[: limit - 2], "...", words[-1]]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _example(version: str) -> tuple[str, str, str]:
    """The smallest multi-host slice: pod type, topology, "e.g. 'v6e-16' (4 hosts x 4 chips)"."""
    multi_host = [t for t in TPU_TOPOLOGIES[version] if _chips(t) > _default_chips_per_host(version, t)]
    topology = min(multi_host, key=lambda t: (_chips(t), max(_dims(t))))
    pod_type = f"{version}-{_chips(topology) * _cores_per_chip(version)}"
    return pod_type, topology, f"e.g. '{pod_type}' ({_chips(topology) // 4} hosts x 4 chips)"


def _parse_tpu(tpu: str, topology: str | None) -> tuple[str, str]:
    """Turn any accepted spelling into the canonical (pod type, topology) pair."""
    name = re.sub(r"^tpu-?v?", "v", tpu.strip().lower())  # Ray's rule: TPU-V6E, tpu7x-8
    match = _NAME_RE.match(name)
    if not match:
        raise ValueError(
            f"{tpu!r} is not a TPU name: use '<version>-<size>' like 'v6e-16', "
            "or tpu='v6e' with topology='4x4'"
        )
    version = _VERSION_ALIASES.get(match[1], match[1])
    if version not in TPU_TOPOLOGIES:
        raise ValueError(
            f"unknown TPU version {match[1]!r} in {tpu!r}: known versions are "
            f"{_or_list(list(TPU_TOPOLOGIES))} (and 'v5e' for v5litepod), {_example('v6e')[2]}"
        )
    per_chip = _cores_per_chip(version)
    chips = None
    if match[2] is not None:
        chips, rest = divmod(int(match[2]), per_chip)
        if rest or chips not in {_chips(t) for t in TPU_TOPOLOGIES[version]}:
            valid = sorted({_chips(t) for t in TPU_TOPOLOGIES[version]})
            counted = "" if per_chip == 1 else " and names count TensorCores (2 per chip)"
            raise ValueError(
                f"{tpu!r} is not a {version} slice: {version} slices have {_or_list(valid)} chips"
                f"{counted}, {_example(version)[2]}"
            )
    if topology is None:
        if chips is None:
            pod_type, example_topology, _ = _example(version)
            raise ValueError(
                f"{tpu!r} needs a size or a topology, e.g. tpu='{pod_type}' or tpu='{version}', "
                f"topology='{example_topology}'"
            )
        return f"{version}-{chips * per_chip}", _default_topology(version, chips)
    topology = topology.strip().lower()
    if topology not in TPU_TOPOLOGIES[version]:
        valid = sorted(TPU_TOPOLOGIES[version], key=lambda t: (_chips(t), _dims(t)))
        raise ValueError(f"topology {topology!r} is not valid for {version}: use {_or_list(valid)}")
    if chips is not None and _chips(topology) != chips:
        raise ValueError(
            f"topology {topology!r} has {_chips(topology)} chips but {tpu!r} has {chips}: "
            f"drop one of them or make them agree"
        )
    return f"{version}-{_chips(topology) * per_chip}", topology


@contextmanager
def _invalid_request(what: str, arguments: Iterable[str] = ()) -> Iterator[None]:
    """Turn pydantic's ValidationError into our InvalidRequestError with a readable message."""
    try:
        yield
    except ValidationError as err:
        problems = []
        for e in err.errors():
            cause = e.get("ctx", {}).get("error")
            if isinstance(cause, InvalidRequestError):  # a nested request already said it all
                raise cause from None
            loc = ".".join(str(p) for p in e["loc"])
            if isinstance(cause, Exception):  # our own validators name the field themselves
                problems.append(str(cause))
            elif e["type"] == "extra_forbidden":
                problems.append(_unknown_argument(loc, arguments))
            elif e["type"] == "missing":
                problems.append(f"{loc} is required")
            elif e["type"] in _TYPE_WORDS:
                problems.append(f"{loc} must be {_TYPE_WORDS[e['type']]} (got {e['input']!r})")
            else:
                msg = f"{e['msg'][:1].lower()}{e['msg'][1:]} (got {e['input']!r})"
                problems.append(f"{loc}: {msg}" if loc else msg)
        raise InvalidRequestError(f"invalid {what}: {'; '.join(problems)}") from None


#: pydantic's error types for a value of the wrong kind, in the words a DAG author would use.
_TYPE_WORDS = {
    "int_type": "a whole number", "int_parsing": "a whole number", "int_from_float": "a whole number",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string",
}


def _unknown_argument(name: str, arguments: Iterable[str]) -> str:
    """``num_slice`` -> "unknown argument 'num_slice': did you mean 'num_slices'? ..." (difflib's closest)."""
    known = sorted(set(arguments) - {"kind"})  # the discriminator is set by the class, never by a user
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return f"unknown argument {name!r}:{hint} the arguments are {', '.join(known)}"


class _Request(BaseModel):
    """Frozen, strict about unknown fields, and raising InvalidRequestError on every way in.

    Pydantic runs a custom ``__init__`` even from model_validate*/TypeAdapter, but turns what
    it raises back into a ValidationError, hence the second wrapping on those entry points.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: What the request is called in error messages (the user's words, not the class name).
    _what: ClassVar[str] = "request"

    def __init__(self, **data: Any) -> None:
        with _invalid_request(self._what, type(self).model_fields):
            super().__init__(**data)

    @classmethod
    def model_validate(cls, *args: Any, **kwargs: Any) -> Any:
        with _invalid_request(cls._what, cls.model_fields):
            return super().model_validate(*args, **kwargs)

    @classmethod
    def model_validate_json(cls, *args: Any, **kwargs: Any) -> Any:
        with _invalid_request(cls._what, cls.model_fields):
            return super().model_validate_json(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self}>"


class TpuSliceRequest(_Request):
    """N whole TPU slices: ``TpuSliceRequest(tpu="v6e-16")`` or ``(tpu="v6e", topology="4x4")``.

    After construction ``tpu`` holds the canonical pod type ("v6e-16"), ``topology`` and
    ``chips_per_host`` are always filled in, so both spellings compare equal.
    ``multislice=True`` with ``num_slices=1`` is a no-op (normalized to False): one slice
    is a valid degenerate multislice, and parametrized DAGs should not have to special-case it.
    """

    _what: ClassVar[str] = "TPU slice request"

    kind: Literal["tpu_slice"] = "tpu_slice"
    tpu: str
    topology: str | None = None
    #: How many slices; `num_slices=(min, max)` asks for an elastic count (stored as `min_slices` and the max).
    num_slices: int = Field(1, ge=1)
    multislice: bool = False
    #: Elastic: the fewest slices the step starts (or resumes) on; None: exactly `num_slices`.
    min_slices: int | None = Field(None, ge=1)
    #: Elastic: how long (seconds from the step's first arrival in the queue) it waits for all `num_slices`
    #: before it starts on as many as are free, at least `min_slices`. None: `ELASTIC_WAIT_S`.
    elastic_wait: float | None = Field(None, ge=0, allow_inf_nan=False)
    #: Override for ambiguous layouts, e.g. v6e 2x4 as two 4-chip hosts instead of one 8-chip host.
    chips_per_host: int | None = Field(None, validate_default=True)
    #: Part of one slice's hosts, by topology: tpu="v6e-16", subslice="2x4" is 2 of its 4 hosts.
    subslice: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _elastic_range(cls, data: Any) -> Any:
        """`num_slices=(min, max)`: an elastic count, kept as `min_slices` and `num_slices` (the max)."""
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("elastic_wait"), bool):
            raise ValueError(f"elastic_wait={data['elastic_wait']!r}: give seconds, e.g. elastic_wait=600")
        given = data.get("num_slices")
        if isinstance(given, str) and (pair := re.fullmatch(r"\s*[(\[]\s*(\d+)\s*,\s*(\d+)\s*[)\]]\s*", given)):
            given = (int(pair[1]), int(pair[2]))  # as Jinja renders "{{ params.slices }}" to text
        if not isinstance(given, (tuple, list)):
            return data
        given = tuple(int(n) if isinstance(n, str) and n.strip().isdigit() else n for n in given)
        if len(given) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in given):
            raise ValueError(f"num_slices={given!r}: give a whole number of slices, or (min, max) for an elastic "
                             "count, e.g. num_slices=(1, 4)")
        low, high = given
        if data.get("min_slices") is not None:
            raise ValueError(f"num_slices={given!r} and min_slices={data['min_slices']!r}: give the range once, as "
                             "num_slices=(min, max)")
        if not 1 <= low <= high:
            raise ValueError(f"num_slices={given!r}: an elastic count needs 1 <= min <= max, e.g. num_slices=(1, 4)")
        return {**data, "num_slices": high, "min_slices": low if low < high else None}

    @model_validator(mode="after")
    def _elastic_fits(self) -> TpuSliceRequest:
        if self.min_slices is not None and self.min_slices >= self.num_slices:
            raise ValueError(f"min_slices={self.min_slices} must be below num_slices={self.num_slices} (the most): "
                             f"give num_slices=({self.min_slices}, <max>) for an elastic count, or drop min_slices")
        if self.elastic_wait is not None and self.min_slices is None:
            raise ValueError(f"elastic_wait={self.elastic_wait:g} applies to an elastic count only: give "
                             f"num_slices=(min, max), or drop elastic_wait")
        return self

    @property
    def elastic(self) -> bool:
        """Whether the step runs on as many slices as there are, between `min_slices` and `num_slices`."""
        return self.min_slices is not None

    @property
    def wait_for_all_s(self) -> float:
        """Elastic: how long the step waits for every slice before it starts on fewer."""
        return ELASTIC_WAIT_S if self.elastic_wait is None else self.elastic_wait

    def with_slices(self, count: int) -> TpuSliceRequest:
        """This request fixed at `count` slices (what one elastic attempt reserves and its program sees)."""
        data = self.model_dump(exclude={"min_slices", "elastic_wait"})
        return TpuSliceRequest(**{**data, "num_slices": count})

    @model_validator(mode="after")
    def _subslice_fits(self) -> TpuSliceRequest:
        if self.subslice is None:
            return self
        what = f"subslice={self.subslice!r} of {self.pod_type} ({self.topology})"
        if self.num_slices > 1:
            raise ValueError(f"{what}: a subslice is part of one slice, so num_slices must be 1 "
                             f"(got num_slices={self.num_slices})")
        if self.chips_per_host != _default_chips_per_host(self.version, self.topology):  # type: ignore[arg-type]
            default = _default_chips_per_host(self.version, self.topology)  # type: ignore[arg-type]
            raise ValueError(f"{what}: subslices need the default {default} chips per host, not "
                             f"chips_per_host={self.chips_per_host}")
        valid = subslices_of(self.version, self.topology) if self.hosts_per_slice > 1 else []  # type: ignore[arg-type]
        if not valid:
            why = ("it is one host: ask for a smaller slice type instead" if self.hosts_per_slice == 1 else
                   "Ray's SubslicePlacementGroup cannot cut that topology")
            raise ValueError(f"{what}: {self.pod_type} cannot be cut into subslices, {why}")
        if self.subslice not in valid:
            raise ValueError(f"{what}: not a subslice of that slice; valid subslices of {self.pod_type} are "
                             f"{_or_list(valid)}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _canonical_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tpu"), str):
            topology = data.get("topology")
            if topology is None or isinstance(topology, str):
                pod_type, topology = _parse_tpu(data["tpu"], topology)
                data = {**data, "tpu": pod_type, "topology": topology}
        return data

    @field_validator("multislice")
    @classmethod
    def _one_slice_is_not_multislice(cls, value: bool, info: ValidationInfo) -> bool:
        return value and info.data.get("num_slices", 1) > 1

    @field_validator("chips_per_host")
    @classmethod
    def _resolve_chips_per_host(cls, value: int | None, info: ValidationInfo) -> int | None:
        if "tpu" not in info.data or not isinstance(info.data.get("topology"), str):
            return value  # the name or topology is already reported as invalid
        version, topology = info.data["tpu"].rsplit("-", 1)[0], info.data["topology"]
        if value is None:
            return _default_chips_per_host(version, topology)
        chips = _chips(topology)
        if value not in _CHIPS_PER_HOST_OPTIONS or chips % value:
            fits = [n for n in _CHIPS_PER_HOST_OPTIONS if chips % n == 0]
            raise ValueError(
                f"chips_per_host={value} does not fit {info.data['tpu']} ({chips} chips): "
                f"use {_or_list(fits)} (default {_default_chips_per_host(version, topology)})"
            )
        return value

    @property
    def pod_type(self) -> str:
        """GCP's accelerator type, e.g. "v6e-16", "v4-32" (v2/v3/v4/v5p/v7x count TensorCores)."""
        return self.tpu

    @property
    def version(self) -> str:
        """Ray's version spelling: "v6e", "v5litepod", "v5p", "v4", "v7x"..."""
        return self.tpu.rsplit("-", 1)[0]

    @property
    def chips_per_slice(self) -> int:
        return _chips(self.topology)  # type: ignore[arg-type]  # always set by validation

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip: 2 on v7x (one per TensorCore), else 1."""
        return _DEVICES_PER_CHIP.get(self.version, 1)

    @property
    def devices_per_host(self) -> int:
        """What `jax.local_device_count()` reports on each host (the simulated cluster shows the same)."""
        return self.chips_per_host * self.devices_per_chip  # type: ignore[operator]

    @property
    def hosts_per_slice(self) -> int:
        return self.chips_per_slice // self.chips_per_host  # type: ignore[operator]

    @property
    def total_hosts(self) -> int:
        return self.hosts_per_slice * self.num_slices

    @property
    def total_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def is_multi_host(self) -> bool:
        """Whether one slice spans several hosts (so one process per host must be gang-scheduled)."""
        return self.hosts_per_slice > 1

    @property
    def accelerator_type(self) -> str:
        """Ray's ``accelerator_type:`` resource suffix for this version, e.g. "TPU-V6E"."""
        return f"TPU-{self.version.upper()}"

    @property
    def head_resource(self) -> str:
        """The custom resource Ray puts on worker 0 of each slice, e.g. "TPU-v6e-16-head"."""
        return f"TPU-{self.pod_type}-head"

    @property
    def programs_note(self) -> str | None:
        """What N slices without multislice run, said once in the task log (None for one program)."""
        if self.num_slices == 1 or self.multislice:
            return None
        return (f"{self.num_slices} x {self.pod_type} without multislice: {self.num_slices} independent JAX programs, "
                f"each on its own slice and seeing its {self.chips_per_slice} chips' devices; multislice=True "
                f"makes them one program over {self.total_chips} chips")

    def __str__(self) -> str:
        details = []
        if self.topology != _default_topology(self.version, self.chips_per_slice):
            details.append(str(self.topology))
        if self.chips_per_host != _default_chips_per_host(self.version, self.topology):  # type: ignore[arg-type]
            details.append(f"{self.chips_per_host} chips/host")
        if self.multislice:
            details.append("multislice")
        if self.subslice:
            details.append(f"subslice {self.subslice}")
        count = f" x{self.num_slices}" if self.num_slices > 1 else ""
        if self.min_slices is not None:
            count = f" x{self.min_slices}-{self.num_slices}"
        return self.pod_type + count + (f" ({', '.join(details)})" if details else "")


#: Elastic steps: how long a step waits for all its slices, by default, before it starts on fewer.
ELASTIC_WAIT_S = 300.0

ResourceName = Literal["GPU", "NPU", "TPU", "neuron_cores", "HPU"]

#: The env var Ray sets to the devices a task may use, per resource.
VISIBLE_DEVICES_ENV: dict[str, str] = {
    "GPU": "CUDA_VISIBLE_DEVICES",
    "NPU": "ASCEND_RT_VISIBLE_DEVICES",
    "TPU": "TPU_VISIBLE_CHIPS",
    "neuron_cores": "NEURON_RT_VISIBLE_CORES",
    "HPU": "HABANA_VISIBLE_MODULES",
}
_FRACTIONAL = ("GPU", "NPU")
_TPU_COUNTS = (1, 2, 4, 8)  # Ray's TPU_VALID_CHIP_OPTIONS
_ACCELERATOR_TYPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_TPU_ACCELERATOR_TYPES = [f"TPU-{v.upper()}" for v in TPU_TOPOLOGIES]


class AcceleratorRequest(_Request):
    """Some of one Ray accelerator resource: ``AcceleratorRequest(resource="GPU", count=0.25)``."""

    _what: ClassVar[str] = "accelerator request"

    kind: Literal["accelerator"] = "accelerator"
    resource: ResourceName
    count: float = Field(gt=0, allow_inf_nan=False)
    #: Pin the hardware model, e.g. "H100" or "TPU-V6E" (Ray's ``accelerator_type`` option).
    accelerator_type: str | None = None

    @field_validator("resource", mode="before")
    @classmethod
    def _known_resource(cls, value: Any) -> Any:
        names = list(VISIBLE_DEVICES_ENV)
        if isinstance(value, str) and value not in names:
            hint = next((f"did you mean {n!r}? " for n in names if n.lower() == value.lower()), "")
            raise ValueError(
                f"unknown resource {value!r}: {hint}Ray accelerator resources are {_or_list(names)}"
            )
        return value

    @model_validator(mode="after")
    def _fits_ray(self) -> AcceleratorRequest:
        res, count, pinned = self.resource, self.count, self.accelerator_type
        if pinned is not None and not _ACCELERATOR_TYPE_RE.match(pinned):
            raise ValueError(
                f"accelerator_type {pinned!r} is not a Ray accelerator type: use letters, digits, "
                "'-' and '_', e.g. 'H100', 'A100-80G' or 'TPU-V6E'"
            )
        if res in _FRACTIONAL and count > 1 and not count.is_integer():
            raise ValueError(
                f"{res} count {count:g} is invalid: fractions must be ≤ 1; above 1 use whole numbers "
                f"(e.g. 0.25, 1 or 2)"
            )
        if res == "TPU" and count not in _TPU_COUNTS:
            raise ValueError(
                f"TPU count {count:g} is invalid: Ray gives tasks {_or_list(_TPU_COUNTS)} whole TPU chips; "
                "for whole slices use TpuSliceRequest(tpu='v6e-16')"
            )
        if res not in _FRACTIONAL and not count.is_integer():
            raise ValueError(f"{res} count {count:g} is invalid: {res} takes whole numbers only, e.g. 1")
        if res == "TPU" and pinned not in (None, *_TPU_ACCELERATOR_TYPES):
            raise ValueError(
                f"accelerator_type {pinned!r} is not a TPU type: use {_or_list(_TPU_ACCELERATOR_TYPES)}"
            )
        return self

    @property
    def visible_devices_env(self) -> str:
        """The env var through which Ray tells the task which devices are its own."""
        return VISIBLE_DEVICES_ENV[self.resource]

    def ray_options(self) -> dict[str, Any]:
        """Ray remote options: ``{"num_gpus": 0.25}`` or ``{"resources": {"NPU": 0.5}}``."""
        if self.resource == "GPU":
            options: dict[str, Any] = {"num_gpus": self.count}
        else:
            options = {"resources": {self.resource: self.count}}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        return options

    def __str__(self) -> str:
        pinned = f" ({self.accelerator_type})" if self.accelerator_type else ""
        return f"{self.resource} x{self.count:g}{pinned}"


StepRequest = Annotated[TpuSliceRequest | AcceleratorRequest, Field(discriminator="kind")]


@cache
def _step_request_adapter() -> TypeAdapter[TpuSliceRequest | AcceleratorRequest]:
    return TypeAdapter(StepRequest)


def request_to_json(request: TpuSliceRequest | AcceleratorRequest) -> str:
    """Serialize a request for the trip to the cluster-side launcher."""
    return request.model_dump_json()


def request_from_json(data: str | bytes) -> TpuSliceRequest | AcceleratorRequest:
    """Rebuild a request from :func:`request_to_json` output; the ``kind`` field picks the type."""
    with _invalid_request("step request"):
        return _step_request_adapter().validate_json(data)
