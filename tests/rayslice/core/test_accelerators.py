"""The accelerator request model: TPU pod-type arithmetic, validation messages, JSON travel."""

import pickle
import re
import subprocess
import sys

import pytest

from rayslice.core.accelerators import (
    AcceleratorRequest,
    TpuSliceRequest,
    request_from_json,
    request_to_json,
)
from rayslice.core.exceptions import (
    HostLostError,
    InvalidRequestError,
    RayJobsError,
    RaysliceError,
    RayUnreachableError,
    StepFailedError,
)

# tpu, pod_type, version, topology, chips/slice, chips/host, hosts/slice
DERIVATIONS = [
    ("v6e-1", "v6e-1", "v6e", "1x1", 1, 1, 1),
    ("v6e-4", "v6e-4", "v6e", "2x2", 4, 4, 1),
    ("v6e-8", "v6e-8", "v6e", "2x4", 8, 8, 1),
    ("v6e-16", "v6e-16", "v6e", "4x4", 16, 4, 4),
    ("v6e-256", "v6e-256", "v6e", "16x16", 256, 4, 64),
    ("v5litepod-8", "v5litepod-8", "v5litepod", "2x4", 8, 8, 1),
    ("v5e-16", "v5litepod-16", "v5litepod", "4x4", 16, 4, 4),
    ("TPU-V6E-16", "v6e-16", "v6e", "4x4", 16, 4, 4),
    # v2, v3, v4, v5p and (per Ray) v7x name TensorCores, 2 per chip.
    ("v2-8", "v2-8", "v2", "2x2", 4, 4, 1),
    ("v3-32", "v3-32", "v3", "4x4", 16, 4, 4),
    ("v4-8", "v4-8", "v4", "2x2x1", 4, 4, 1),
    ("v4-32", "v4-32", "v4", "2x2x4", 16, 4, 4),
    ("v5p-128", "v5p-128", "v5p", "4x4x4", 64, 4, 16),
    ("v7x-8", "v7x-8", "v7x", "2x2x1", 4, 4, 1),
    ("tpu7x-16", "v7x-16", "v7x", "2x2x2", 8, 4, 2),
]


@pytest.mark.parametrize("tpu,pod_type,version,topology,chips,per_host,hosts", DERIVATIONS)
def test_pod_type_derivation(tpu, pod_type, version, topology, chips, per_host, hosts):
    req = TpuSliceRequest(tpu=tpu)
    assert (req.pod_type, req.tpu, req.version, req.topology) == (pod_type, pod_type, version, topology)
    assert (req.chips_per_slice, req.chips_per_host, req.hosts_per_slice) == (chips, per_host, hosts)
    assert (req.total_chips, req.total_hosts, req.is_multi_host) == (chips, hosts, hosts > 1)
    assert req.accelerator_type == f"TPU-{version.upper()}"
    assert req.head_resource == f"TPU-{pod_type}-head"


def test_ray_spellings_of_accelerator_type():
    assert TpuSliceRequest(tpu="v5e-8").accelerator_type == "TPU-V5LITEPOD"
    assert TpuSliceRequest(tpu="v7x-8").accelerator_type == "TPU-V7X"


@pytest.mark.parametrize(
    "tpu,topology,pod_type",
    [
        ("v6e", "4x4", "v6e-16"),
        ("v6e-16", "4x4", "v6e-16"),
        ("v5e", "2x4", "v5litepod-8"),
        ("TPU-V4", "2x2x4", "v4-32"),
        ("v5p", " 4X4X4 ", "v5p-128"),
        ("v7x", "2x2x2", "v7x-16"),
    ],
)
def test_version_and_topology_equals_pod_type(tpu, topology, pod_type):
    req = TpuSliceRequest(tpu=tpu, topology=topology)
    assert req == TpuSliceRequest(tpu=pod_type)
    assert hash(req) == hash(TpuSliceRequest(tpu=pod_type))


def test_non_default_topology_keeps_its_shape():
    req = TpuSliceRequest(tpu="v6e", topology="2x8")
    assert (req.pod_type, req.topology, req.hosts_per_slice) == ("v6e-16", "2x8", 4)
    assert req != TpuSliceRequest(tpu="v6e-16")
    assert str(req) == "v6e-16 (2x8)"


def test_chips_per_host_override_splits_an_ambiguous_slice():
    default, split = TpuSliceRequest(tpu="v6e-8"), TpuSliceRequest(tpu="v6e-8", chips_per_host=4)
    assert (default.hosts_per_slice, default.is_multi_host) == (1, False)
    assert (split.hosts_per_slice, split.chips_per_host, split.is_multi_host) == (2, 4, True)
    assert TpuSliceRequest(tpu="v6e-16", chips_per_host=4) == TpuSliceRequest(tpu="v6e-16")
    assert str(split) == "v6e-8 (4 chips/host)"


def test_multislice_totals():
    req = TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)
    assert (req.total_hosts, req.total_chips, req.hosts_per_slice, req.chips_per_slice) == (8, 32, 4, 16)
    assert str(req) == "v6e-16 x2 (multislice)"
    assert repr(req) == "<TpuSliceRequest v6e-16 x2 (multislice)>"
    assert str(TpuSliceRequest(tpu="v6e-16", num_slices=3)) == "v6e-16 x3"


def test_multislice_of_one_slice_is_a_no_op():
    assert TpuSliceRequest(tpu="v6e-16", multislice=True) == TpuSliceRequest(tpu="v6e-16")
    assert TpuSliceRequest(tpu="v6e-16", multislice=True).multislice is False


@pytest.mark.parametrize(
    "req",
    [
        TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True),
        TpuSliceRequest(tpu="v6e-8", chips_per_host=4),
        TpuSliceRequest(tpu="v6e", topology="2x8"),
        TpuSliceRequest(tpu="v5e-4"),
        TpuSliceRequest(tpu="v5p-128"),
        AcceleratorRequest(resource="GPU", count=0.25, accelerator_type="H100"),
        AcceleratorRequest(resource="TPU", count=4, accelerator_type="TPU-V6E"),
        AcceleratorRequest(resource="neuron_cores", count=2),
    ],
    ids=str,
)
def test_json_round_trip_through_the_union(req):
    text = request_to_json(req)
    back = request_from_json(text)
    assert type(back) is type(req) and back == req
    assert request_from_json(text.encode()) == req
    assert type(req).model_validate_json(text) == req


def test_json_carries_the_discriminator():
    assert '"kind":"tpu_slice"' in request_to_json(TpuSliceRequest(tpu="v6e-16"))
    assert '"kind":"accelerator"' in request_to_json(AcceleratorRequest(resource="GPU", count=1))


def test_requests_are_frozen():
    req = TpuSliceRequest(tpu="v6e-16")
    with pytest.raises(Exception, match="frozen"):
        req.num_slices = 2


@pytest.mark.parametrize(
    "kwargs,options,env",
    [
        (dict(resource="GPU", count=0.25), {"num_gpus": 0.25}, "CUDA_VISIBLE_DEVICES"),
        (
            dict(resource="GPU", count=2, accelerator_type="H100"),
            {"num_gpus": 2, "accelerator_type": "H100"},
            "CUDA_VISIBLE_DEVICES",
        ),
        (dict(resource="NPU", count=0.5), {"resources": {"NPU": 0.5}}, "ASCEND_RT_VISIBLE_DEVICES"),
        (
            dict(resource="TPU", count=4, accelerator_type="TPU-V6E"),
            {"resources": {"TPU": 4}, "accelerator_type": "TPU-V6E"},
            "TPU_VISIBLE_CHIPS",
        ),
        (
            dict(resource="neuron_cores", count=2),
            {"resources": {"neuron_cores": 2}},
            "NEURON_RT_VISIBLE_CORES",
        ),
        (dict(resource="HPU", count=1), {"resources": {"HPU": 1}}, "HABANA_VISIBLE_MODULES"),
    ],
)
def test_ray_options_and_visible_devices(kwargs, options, env):
    req = AcceleratorRequest(**kwargs)
    assert req.ray_options() == options
    assert req.visible_devices_env == env


def test_accelerator_str():
    assert str(AcceleratorRequest(resource="GPU", count=0.25, accelerator_type="H100")) == "GPU x0.25 (H100)"
    assert str(AcceleratorRequest(resource="TPU", count=4)) == "TPU x4"
    assert repr(AcceleratorRequest(resource="NPU", count=1)) == "<AcceleratorRequest NPU x1>"


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (
            dict(tpu="v6e-15"),
            ["'v6e-15' is not a v6e slice", "1, 4, 8, 16, 32, 64, 128 or 256 chips", "'v6e-16'"],
        ),
        (dict(tpu="v4-12"), ["not a v4 slice", "TensorCores", "'v4-16'"]),
        (dict(tpu="v5p-127"), ["not a v5p slice", "TensorCores"]),
        (dict(tpu="v9z-16"), ["unknown TPU version 'v9z'", "v6e", "v5litepod"]),
        (dict(tpu="hello"), ["not a TPU name", "'v6e-16'"]),
        (dict(tpu="v6e"), ["needs a size or a topology", "tpu='v6e-16'", "topology='4x4'"]),
        (dict(tpu="v6e", topology="3x3"), ["'3x3' is not valid for v6e", "4x4", "16x16"]),
        (dict(tpu="v4", topology="4x4"), ["'4x4' is not valid for v4", "2x2x1"]),
        (dict(tpu="v6e-16", topology="2x4"), ["'2x4' has 8 chips", "'v6e-16' has 16"]),
        (dict(tpu="v6e-16", num_slices=0), ["num_slices", "greater than or equal to 1", "got 0"]),
        (dict(tpu="v6e-16", num_slices=-2), ["num_slices", "got -2"]),
        (dict(tpu="v6e-16", chips_per_host=3), ["chips_per_host=3", "v6e-16", "1, 2, 4 or 8"]),
        (dict(tpu="v6e-4", chips_per_host=8), ["chips_per_host=8", "1, 2 or 4"]),
        (dict(tpu="v6e-16", num_slice=2), ["unknown argument 'num_slice'", "did you mean 'num_slices'",
                                           "the arguments are chips_per_host, elastic_wait, min_slices, multislice, "
                                           "num_slices, subslice, topology, tpu"]),
        (dict(tpu="v6e-16", num_slices="two"), ["num_slices must be a whole number (got 'two')"]),
        (dict(tpu="v6e-16", multislice="maybe"), ["multislice must be true or false (got 'maybe')"]),
        (dict(tpu=16), ["tpu must be a string (got 16)"]),
        (dict(), ["tpu is required"]),
    ],
    ids=repr,
)
def test_bad_tpu_requests(kwargs, words):
    with pytest.raises(InvalidRequestError) as info:
        TpuSliceRequest(**kwargs)
    message = str(info.value)
    assert message.startswith("invalid TPU slice request: ")
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(resource="GPU", count=1.5), ["GPU count 1.5", "fractions must be ≤ 1", "whole numbers"]),
        (dict(resource="NPU", count=2.5), ["NPU count 2.5", "fractions must be ≤ 1"]),
        (dict(resource="TPU", count=0.5), ["TPU count 0.5", "1, 2, 4 or 8", "TpuSliceRequest"]),
        (dict(resource="TPU", count=3), ["TPU count 3", "1, 2, 4 or 8"]),
        (dict(resource="HPU", count=0.25), ["HPU count 0.25", "whole numbers"]),
        (dict(resource="neuron_cores", count=1.5), ["neuron_cores count 1.5", "whole numbers"]),
        (dict(resource="GPU", count=0), ["count", "greater than 0"]),
        (dict(resource="GPU", count=-1), ["count", "greater than 0", "got -1"]),
        (dict(resource="GPU", count=float("nan")), ["count", "finite"]),
        (dict(resource="gpu", count=1), ["unknown resource 'gpu'", "did you mean 'GPU'"]),
        (dict(resource="FPGA", count=1), ["unknown resource 'FPGA'", "GPU, NPU, TPU, neuron_cores or HPU"]),
        (dict(resource="GPU", count=1, accelerator_type=""), ["accelerator_type ''", "'H100'"]),
        (dict(resource="GPU", count=1, accelerator_type="accelerator_type:H100"), ["not a Ray accelerator"]),
        (dict(resource="TPU", count=4, accelerator_type="v6e"), ["not a TPU type", "TPU-V6E"]),
        (dict(resource="GPU"), ["count is required"]),
        (dict(resource="GPU", count=0.5, acelerator_type="H100"), ["unknown argument 'acelerator_type'",
                                                                  "did you mean 'accelerator_type'"]),
        (dict(resource="GPU", count="half"), ["count must be a number (got 'half')"]),
    ],
    ids=repr,
)
def test_bad_accelerator_requests(kwargs, words):
    with pytest.raises(InvalidRequestError) as info:
        AcceleratorRequest(**kwargs)
    message = str(info.value)
    assert message.startswith("invalid accelerator request: ")
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "text,words",
    [
        ('{"kind": "tpu_slice", "tpu": "v6e-15"}', ["invalid TPU slice request", "not a v6e slice"]),
        ('{"kind": "accelerator", "resource": "GPU", "count": 1.5}', ["invalid accelerator request"]),
        ('{"kind": "fpga"}', ["invalid step request", "'tpu_slice', 'accelerator'"]),
        ('{"tpu": "v6e-16"}', ["invalid step request", "kind"]),
        ("not json", ["invalid step request", "JSON"]),
    ],
)
def test_bad_json_raises_our_error(text, words):
    with pytest.raises(InvalidRequestError) as info:
        request_from_json(text)
    for word in words:
        assert word in str(info.value)


def test_model_validate_raises_our_error_too():
    with pytest.raises(InvalidRequestError, match="not a v6e slice"):
        TpuSliceRequest.model_validate({"tpu": "v6e-15"})
    with pytest.raises(InvalidRequestError, match="fractions must be"):
        AcceleratorRequest.model_validate_json('{"resource": "GPU", "count": 1.5}')


def test_several_slices_without_multislice_say_they_are_independent_programs():
    note = TpuSliceRequest(tpu="v6e-16", num_slices=2).programs_note
    assert note is not None and "2 independent JAX programs" in note and "multislice=True" in note
    assert "one program over 32 chips" in note
    assert TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True).programs_note is None
    assert TpuSliceRequest(tpu="v6e-16").programs_note is None


def test_invalid_request_is_a_value_error():
    with pytest.raises(ValueError):
        TpuSliceRequest(tpu="v6e-15")


def test_errors_keep_their_attributes_across_pickle():
    err = pickle.loads(pickle.dumps(HostLostError("host died", slice_index=1, worker_id=3, host="10.0.0.7")))
    assert isinstance(err, StepFailedError) and isinstance(err, RaysliceError)
    assert (str(err), err.slice_index, err.worker_id, err.host, err.cause) == (
        "host died",
        1,
        3,
        "10.0.0.7",
        "",
    )
    err = pickle.loads(pickle.dumps(RayUnreachableError("no dashboard", status_code=None)))
    assert isinstance(err, RayJobsError) and err.status_code is None


def test_import_stays_cheap():
    code = (
        "import sys, rayslice.core.accelerators\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('ray', 'jax', 'airflow')]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tables_match_the_installed_ray():
    """Guard against drift on a Ray upgrade; our only deliberate extra is 2x2 (v2-8/v3-8)."""
    ray_tpu = pytest.importorskip("ray._private.accelerators.tpu")
    from rayslice.core.accelerators import TPU_TOPOLOGIES

    assert set(TPU_TOPOLOGIES) == set(ray_tpu.VALID_TPU_TYPES)
    for version, topologies in TPU_TOPOLOGIES.items():
        extra = {"2x2"} if version in ("v2", "v3") else set()
        assert topologies == ray_tpu.VALID_TPU_TOPOLOGY[version] | extra, version
        for topology in topologies:
            req = TpuSliceRequest(tpu=version, topology=topology)
            assert req.pod_type == ray_tpu.infer_tpu_pod_type_from_topology(topology, version)
            assert req.chips_per_host == ray_tpu.get_chips_per_host(topology, version)
            assert req.accelerator_type == f"TPU-{version.upper()}"


@pytest.mark.parametrize(("tpu", "per_chip", "per_host"), [
    ("tpu7x-8", 2, 8), ("v7x-16", 2, 8), ("v6e-16", 1, 4), ("v6e-8", 1, 8), ("v5p-8", 1, 4), ("v4-8", 1, 4)])
def test_jax_devices_per_chip_are_two_on_v7x_only(tpu, per_chip, per_host):
    request = TpuSliceRequest(tpu=tpu)
    assert (request.devices_per_chip, request.devices_per_host) == (per_chip, per_host)


@pytest.mark.parametrize(("tpu", "subslice", "shown"), [
    ("v6e-16", "2x4", "v6e-16 (subslice 2x4)"), ("v6e-16", "2x2", "v6e-16 (subslice 2x2)"),
    ("v7x-32", "2x2x2", "v7x-32 (subslice 2x2x2)"), ("v5litepod-64", "4x4", "v5litepod-64 (subslice 4x4)")])
def test_a_subslice_of_a_multi_host_slice_is_accepted_where_ray_can_cut_it(tpu, subslice, shown):
    request = TpuSliceRequest(tpu=tpu, subslice=subslice)
    assert str(request) == shown and TpuSliceRequest.model_validate_json(request.model_dump_json()) == request


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"tpu": "v6e-16", "subslice": "2x8"},
     "subslice='2x8' of v6e-16 (4x4): not a subslice of that slice; valid subslices of v6e-16 are 2x2 or 2x4"),
    ({"tpu": "v6e-16", "subslice": "4x4"}, "valid subslices of v6e-16 are 2x2 or 2x4"),
    ({"tpu": "v6e-8", "subslice": "2x2"},
     "v6e-8 cannot be cut into subslices, it is one host: ask for a smaller slice type instead"),
    ({"tpu": "v5litepod", "topology": "2x8", "subslice": "2x2"},
     "v5litepod-16 cannot be cut into subslices, Ray's SubslicePlacementGroup cannot cut that topology"),
    ({"tpu": "v6e-16", "subslice": "2x4", "num_slices": 2}, "num_slices must be 1 (got num_slices=2)"),
    ({"tpu": "v6e-16", "subslice": "2x4", "chips_per_host": 2}, "need the default 4 chips per host"),
])
def test_a_subslice_the_type_does_not_allow_is_refused_at_parse_time_in_words(kwargs, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)):
        TpuSliceRequest(**kwargs)
