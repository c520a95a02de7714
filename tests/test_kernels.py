"""kernels: oneDNN's own log says which ISA ran the converted CNN's matrix work."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from machine import needs_bf16_units, needs_onednn
from tensorflow.core.framework import step_stats_pb2

from amp_rewrite import cli, convert_file
from amp_rewrite.core import hardware
from amp_rewrite.core.errors import INPUT_EXIT, INTERNAL_EXIT, AmpRewriteError, InputError
from amp_rewrite.tools.kernels import (
    KernelReport,
    classify_gpu_kernels,
    format_report,
    kernel_report,
    misaligned_dims,
    onednn_kernels,
    parse_onednn_log,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cnn_fp32.pb"
BATCH = 4


def _conv_macs(batch):
    # the example CNN: 8x8 images, SAME 3x3 convolutions 1->32 and 32->64 channels
    return batch * 8 * 8 * 9 * (1 * 32 + 32 * 64)


@needs_onednn
@needs_bf16_units
def test_bfloat16_cnn_convolutions_run_on_16bit_units(tmp_path):
    conv = tmp_path / "cnn_bf16.pb"
    convert_file(EXAMPLE, conv, target="bfloat16", device="cpu", min_matrix_intensity=0)
    code = cli.main(["kernels", str(conv), "--device", "cpu", "--shape", f"images={BATCH},8,8,1",
                     "--json", str(tmp_path / "k.json"), "-q"])
    assert code == 0
    report = json.loads((tmp_path / "k.json").read_text())
    convs = [k for k in report["kernels"] if k["kind"] == "convolution"]
    assert len(convs) == 2
    for k in convs:
        assert k["dtype"] == "bf16" and k["sixteen_bit"]
        assert "amx" in k["implementation"] or "avx512_core_bf16" in k["implementation"]
    # the work counted from oneDNN's problem descriptors is the graph's real work
    assert sum(k["macs"] for k in convs) == _conv_macs(BATCH)
    assert report["share"] == 1.0


@needs_onednn
def test_fp32_original_has_no_16bit_work():
    report = onednn_kernels(EXAMPLE, shapes={"images": (BATCH, 8, 8, 1)})
    convs = [k for k in report.kernels if k.kind == "convolution"]
    assert len(convs) == 2 and all(k.dtype == "f32" and not k.sixteen_bit for k in convs)
    assert sum(k.macs for k in convs) == _conv_macs(BATCH)
    assert report.share == 0.0 and report.onednn is True


def test_onednn_off_is_reported_not_mistaken_for_no_work(monkeypatch, caplog):
    """As on an AVX2-only CPU by default: oneDNN is off, matrix ops run on Eigen, nothing logs."""
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")   # the child process reads it
    with caplog.at_level("WARNING", logger="amp_rewrite"):
        report = onednn_kernels(EXAMPLE, shapes={"images": (BATCH, 8, 8, 1)})
    assert report.onednn is False and report.kernels == [] and report.share is None
    assert "TF_ENABLE_ONEDNN_OPTS=1" in caplog.text


def test_float16_alignment_lists_dims_not_multiple_of_8(tmp_path):
    conv = tmp_path / "cnn_fp16.pb"
    convert_file(EXAMPLE, conv, target="float16")
    found = {m["op"] + ":" + ",".join(f"{k}={v}" for k, v in sorted(m["not_multiple_of_8"].items()))
             for m in misaligned_dims(conv, shapes={"images": (BATCH, 8, 8, 1)})}
    # the first conv reads 1 channel; the last MatMul has 10 classes; the rest are 32/64/128/1024
    assert found == {"Conv2D:C=1", "MatMul:N=10"}
    bf16 = tmp_path / "cnn_bf16.pb"
    convert_file(EXAMPLE, bf16, target="bfloat16", device="cpu", min_matrix_intensity=0)
    assert misaligned_dims(bf16) == []   # only float16 nodes are Tensor Core candidates


def test_gpu_kernel_names_classified():
    """Kernel names as cuBLAS/cuDNN print them in a step trace."""
    stats = step_stats_pb2.StepStats()
    stream = stats.dev_stats.add(device="/device:GPU:0/stream:all")
    names = {"volta_fp16_s884gemm_fp16_128x128_ldg8_f2f_nn": True,
             "ampere_fp16_s16816gemm_fp16_256x128_ldg8_f2f_stages_64x3_nn": True,
             "cutlass_tensorop_h1688gemm_128x128_32x2_nn_align8": True,
             "volta_sgemm_128x64_nn": False,
             "implicit_convolve_sgemm": False}
    for name in names:
        stream.node_stats.add(node_name="fc/MatMul", timeline_label=name)
    stream.node_stats.add(node_name="relu", timeline_label="Eigen::internal::EigenMetaKernel")
    stats.dev_stats.add(device="/device:GPU:0").node_stats.add(node_name="fc/MatMul")
    kernels = classify_gpu_kernels(stats)
    assert {k.implementation: k.sixteen_bit for k in kernels} == names


@needs_onednn
@needs_bf16_units
def test_savedmodel_signature_runs_on_16bit_units(tmp_path):
    r = np.random.default_rng(0)

    class Net(tf.Module):
        def __init__(self):
            self.k = tf.Variable(r.normal(0, 0.3, (3, 3, 3, 16)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 16, 16, 3], tf.float32, name="images")])
        def __call__(self, images):
            return {"y": tf.nn.relu(tf.nn.conv2d(images, self.k, 1, "SAME"))}

    net = Net()
    tf.saved_model.save(net, str(tmp_path / "fp32"), signatures=net.__call__)
    convert_file(tmp_path / "fp32", tmp_path / "bf16", target="bfloat16", device="cpu",
                 min_matrix_intensity=0)
    report = kernel_report(tmp_path / "bf16", device="cpu", shapes={"images": (2, 16, 16, 3)})
    (conv,) = [k for k in report.kernels if k.kind == "convolution"]
    assert conv.sixteen_bit and conv.macs == 2 * 16 * 16 * 16 * 3 * 9
    assert report.share == 1.0


def test_gpu_device_without_a_gpu_is_exit_2():
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU; the refusal is for machines without one")
    assert cli.main(["kernels", str(EXAMPLE), "--device", "gpu"]) == 2


def _mismatched(tmp_path):
    """A graph TensorFlow cannot run on the data given: x [4, 8] times a [16, 10] matrix."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, None], name="x")
        tf.matmul(x, tf.constant(np.ones((16, 10), np.float32)), name="logits")
    path = tmp_path / "mismatch.pb"
    path.write_bytes(g.as_graph_def().SerializeToString())
    np.savez(tmp_path / "x.npz", x=np.ones((4, 8), np.float32))
    return path, tmp_path / "x.npz"


def test_a_model_tensorflow_cannot_run_is_the_users_error_with_tensorflows_reason(tmp_path, capsys):
    path, data = _mismatched(tmp_path)
    with pytest.raises(InputError, match="Matrix size-incompatible"):
        onednn_kernels(path, inputs=data)
    code = cli.main(["kernels", str(path), "--device", "cpu", "--inputs", str(data)])
    err = capsys.readouterr().err
    assert code == INPUT_EXIT and "Matrix size-incompatible" in err and str(path) in err
    assert len(err.strip().splitlines()) == 1 and "bug" not in err


_BUGS = {
    # our worker code raising (an IR misuse, say) while the child runs the model
    "exception": "def broken(): raise IRError('no node named \\'x\\'')",
    # our worker code crashing the process outright
    "crash": "def broken(): os.abort()",
}


@pytest.mark.parametrize("bug", sorted(_BUGS))
def test_a_failure_of_our_own_child_process_is_an_internal_error(bug, tmp_path, monkeypatch,
                                                                  capsys):
    """One of our functions in the child (the oneDNN probe it calls first) made to fail,
    through a sitecustomize only the child imports; the model itself runs fine."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nfrom amp_rewrite.core import hardware\nfrom amp_rewrite.core.errors import IRError\n"
        f"{_BUGS[bug]}\nhardware.onednn_enabled = broken\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(AmpRewriteError) as caught:
        onednn_kernels(EXAMPLE, shapes={"images": (BATCH, 8, 8, 1)})
    assert not isinstance(caught.value, InputError)
    assert ("IRError" if bug == "exception" else "SIGABRT") in str(caught.value)
    code = cli.main(["kernels", str(EXAMPLE), "--device", "cpu", "-q"])
    err = capsys.readouterr().err
    assert code == INTERNAL_EXIT and "bug in amp-rewrite" in err
    assert len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------- oneDNN's ISA names
# Each ISA name oneDNN's verbose log can print (src/cpu/x64/cpu_isa_traits.hpp, 2.x and 3.x),
# with the /proc/cpuinfo flags its mayiuse() needs, and what its kernels do with bf16 and f16
# source data: "16" multiplied by a 16-bit unit, "32" converted in hardware and multiplied in
# float32 (get_mac_emu_data_type), None: no instruction for the type (oneDNN emulates it, or
# has no such kernel). Written out here, not read from the module, so that a wrong entry there
# fails.
_AVX512 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
_BF16 = _AVX512 | {"avx512_vnni", "avx512_bf16"}
_FP16 = _BF16 | {"avx512_fp16", "avx_vnni"}
_AMX = _FP16 | {"amx_tile", "amx_int8", "amx_bf16"}
ISAS = {
    "sse41": ({"sse4_1"}, None, None),
    "avx": ({"avx"}, None, None),
    "avx2": ({"avx2"}, None, None),
    "avx2_vnni": ({"avx2", "avx_vnni"}, None, None),
    "avx2_vnni_2": ({"avx2", "avx_vnni", "avx_vnni_int8", "avx_ne_convert"}, "32", "32"),
    "avx512_core": (_AVX512, None, None),
    "avx512_core_vnni": (_AVX512 | {"avx512_vnni"}, None, None),
    "avx512_core_bf16": (_BF16, "16", None),
    "avx512_core_bf16_ymm": (_BF16, "16", None),
    "avx512_core_amx_int8": (_BF16 | {"amx_tile", "amx_int8"}, "16", None),
    "avx512_core_amx_bf16": (_BF16 | {"amx_tile", "amx_bf16"}, "16", None),
    "avx512_core_fp16": (_FP16, "16", "32"),
    "avx10_1_512": (_FP16, "16", "32"),
    "avx512_core_amx": (_AMX, "16", "32"),
    "avx10_1_512_amx": (_AMX, "16", "32"),
    "avx512_core_amx_fp16": (_AMX | {"amx_fp16"}, "16", "16"),
    "avx10_1_512_amx_fp16": (_AMX | {"amx_fp16"}, "16", "16"),
    "avx10_2_512": (_FP16 | {"avx_vnni_int8", "avx_ne_convert"}, "16", "16"),
    "avx10_2": (_FP16 | {"avx_vnni_int8", "avx_ne_convert"}, "16", "16"),
    "avx10_2_512_amx_2": (_AMX | {"amx_fp16", "avx_vnni_int8", "avx_ne_convert"}, "16", "16"),
    "avx10_2_amx_2": (_AMX | {"amx_fp16", "avx_vnni_int8", "avx_ne_convert"}, "16", "16"),
}


def _verbose(isa, dt):
    """Two exec lines as oneDNN v3 prints them: a 1x1 convolution and a matmul on ``isa``."""
    return "\n".join([
        "onednn_verbose,v1,info,oneDNN v3.7.3 (commit N/A)",
        f"onednn_verbose,v1,primitive,exec,cpu,convolution,brgconv_1x1:{isa},forward_inference,"
        f"src:{dt}::blocked:acdb::f0 wei:{dt}:a:blocked:AcdB16b16a2b::f0 bia:f32::blocked:a::f0 "
        f"dst:{dt}::blocked:acdb::f0,attr-scratchpad:user,alg:convolution_direct,"
        "mb1_ic32oc64_ih56oh56kh1sh1dh0ph0_iw56ow56kw1sw1dw0pw0,0.11",
        f"onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:{isa},undef,"
        f"src:{dt}::blocked:ab::f0 wei:{dt}:a:blocked:BA16a64b2a::f0 dst:{dt}::blocked:ab::f0,"
        "attr-scratchpad:user,,1x768:768x3072,0.05"])


@pytest.mark.parametrize("isa", sorted(ISAS))
@pytest.mark.parametrize("dt", ["bf16", "f16", "f32"])
def test_each_onednn_isa_name_is_read_as_what_it_runs(isa, dt):
    _, bf16, f16 = ISAS[isa]
    want = {"bf16": bf16, "f16": f16, "f32": None}[dt]
    kernels, runtime = parse_onednn_log(_verbose(isa, dt))
    assert runtime.startswith("oneDNN v3.7.3") and len(kernels) == 2
    assert [k.implementation for k in kernels] == [f"brgconv_1x1:{isa}", f"brg_matmul:{isa}"]
    assert sum(k.macs for k in kernels) == 56 * 56 * 32 * 64 + 768 * 3072
    for k in kernels:
        assert k.sixteen_bit == (want is not None), (isa, dt)
        assert k.mac == ("" if want is None else "f32" if want == "32" else dt), (isa, dt)
    unit = {None: "not on a 16-bit unit", "32": "16-bit unit, float32 math",
            "16": "16-bit matrix unit"}[want]
    text = format_report(KernelReport("CPU", runtime, True, kernels))
    assert all(line.endswith(unit) for line in text.splitlines()[1:3]), text
    share = "100.0%" if want else "0.0%"
    assert f"MatMul/Conv work on 16-bit units: {share} (" in text
    assert ("converts and multiplies in float32" in text) == (want == "32"), text


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_the_kernels_verdict_agrees_with_the_cpu_line(isa):
    """On the CPU each ISA needs, the CPU line's "<target> runs on ..." and the kernels'
    16-bit verdict agree: a kernel on a 16-bit unit where the line says the target runs on
    one, and a 16-bit multiply only where it says so."""
    flags, bf16, f16 = ISAS[isa]
    for target, dt, want in (("bfloat16", "bf16", bf16), ("float16", "f16", f16)):
        runs = hardware.target_note(target, frozenset(flags)).startswith(f"{target} runs on")
        (kernel, _), _ = parse_onednn_log(_verbose(isa, dt))
        if runs:
            assert kernel.sixteen_bit, (isa, target)
        if kernel.mac == dt:
            assert runs, (isa, target)


def test_float16_on_an_avx512_fp16_cpu_reads_as_running_on_it():
    """The issue's EfficientNetV2B0 log on a Sapphire Rapids: 69 1x1 convolutions on
    avx10_1_512 in f16, under a CPU line that says float16 runs on AVX512-FP16."""
    log = "\n".join(_verbose("avx10_1_512", "f16").splitlines()[:2] * 69)
    kernels, runtime = parse_onednn_log(log)
    text = format_report(KernelReport("CPU", runtime, True, kernels))
    assert " 69 x convolution   brgconv_1x1:avx10_1_512" in text
    assert "MatMul/Conv work on 16-bit units: 100.0% (69 of 69 kernels)" in text
    assert "f16 on avx10_1_512" in text
    line = hardware.machine_line("float16", frozenset(ISAS["avx10_1_512_amx"][0]), "cpu")
    assert "float16 runs on AVX512-FP16 here (oneDNN)" in line
