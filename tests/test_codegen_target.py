"""Code generation (target.code_generation_target) reassociates float additions only with
fast_math, and never against the target's own setting; LLVM's SLP vectorizer is off unless the
target asks for it."""

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tightfit.device_rpc.tuning import build_candidate
from tightfit.target import resolve_target

SLP_OFF = "-vectorize-slp=false"


def test_fast_math_lets_llvm_reassociate_float_additions():
    target = resolve_target("host").code_generation()
    assert bool(target.attrs["fast-math-reassoc"])
    assert target.attrs["mcpu"] == resolve_target("host").tvm_target.attrs["mcpu"]


def test_without_fast_math_nothing_is_reassociated_and_the_rest_of_the_target_is_kept():
    host = resolve_target("host")
    target = host.code_generation(fast_math=False)
    assert "fast-math-reassoc" not in target.attrs
    assert list(target.attrs["cl-opt"]) == [SLP_OFF]
    assert target.attrs["mcpu"] == host.tvm_target.attrs["mcpu"]
    assert int(target.attrs["num-cores"]) == int(host.tvm_target.attrs["num-cores"])


@pytest.mark.parametrize("setting", [False, True])
def test_a_target_that_sets_reassociation_itself_keeps_its_setting(setting):
    target = resolve_target({"kind": "llvm", "fast-math-reassoc": setting})
    assert bool(target.code_generation().attrs["fast-math-reassoc"]) is setting


def test_a_target_that_sets_slp_itself_keeps_its_setting_and_other_options_are_kept():
    own = resolve_target({"kind": "llvm", "cl-opt": ["-vectorize-slp=true"]})
    assert list(own.code_generation().attrs["cl-opt"]) == ["-vectorize-slp=true"]
    other = resolve_target({"kind": "llvm", "cl-opt": ["-unroll-threshold=100"]})
    assert list(other.code_generation().attrs["cl-opt"]) == ["-unroll-threshold=100", SLP_OFF]


@T.prim_func(private=True, s_tir=True)
def causal_padding_mask(mask: T.Buffer((2, 1, 3, 6), "bool"), zero: T.Buffer((), "float32"),
                        minus_inf: T.Buffer((), "float32"), lengths: T.Buffer((2,), "int64"),
                        queries: T.Buffer((1,), "int64"), rows: T.Buffer((3, 1), "int64"),
                        columns: T.Buffer((1, 6), "int64"), keys: T.Buffer((1, 6), "int64"),
                        out: T.Buffer((2, 1, 3, 6), "float32")):
    """ONNX Attention's mask in test_attention_4d_causal_nonpad_attn_mask_composition as the
    fallback schedule leaves it (a loop nest): 0 where the bool mask, causality (query q sees
    keys up to q + length - queries) and the key padding (keys below length) all allow, else
    -inf."""
    T.func_attr({"tirx.noalias": True})
    for b, h, q, k in T.grid(T.int64(2), T.int64(1), T.int64(3), T.int64(6)):
        with T.sblock("T_add2"):
            vb, vh, vq, vk = T.axis.remap("SSSS", [b, h, q, k])
            out[vb, vh, vq, vk] = (
                T.Select(T.int64(0) < T.Cast("int64", mask[vb, vh, vq, vk]), zero[()], minus_inf[()])
                + T.Select(T.int64(0) < T.Cast("int64", T.int64(0) <= rows[vq, T.int64(0)]
                                               + (lengths[(vb + vh) % T.int64(2)] - queries[T.int64(0)])
                                               - columns[T.int64(0), vk]), zero[()], minus_inf[()])
                + T.Select(T.int64(0) < T.Cast("int64", keys[T.int64(0), vk % T.int64(6)]
                                               < lengths[(vk // T.int64(6) + vb + vh) % T.int64(2)]),
                           zero[()], minus_inf[()]))


@pytest.mark.parametrize("build", ["compile", "tuning candidate"])
def test_an_attention_mask_that_slp_miscompiled_for_avx512_is_computed_right(build):
    """With SLP on, LLVM 22 got element [1, 0, 0, 3] wrong (0 for -inf) on AVX-512 hosts
    (znver4/5, skylake-avx512); elsewhere the test passes either way. MetaSchedule's tuning
    candidates are built as the compile builds them."""
    mod = tvm.IRModule({"main": causal_padding_mask.with_attr("global_symbol", "main")})
    host = resolve_target("host")
    with tvm.transform.PassContext(opt_level=3):
        if build == "compile":
            library = tvm.compile(mod, target=host.code_generation())
        else:
            library = build_candidate(mod, host.tvm_target, None)
    mask = np.ones((2, 1, 3, 6), bool)
    mask[:, :, :, 4:] = False
    lengths, queries = np.array([4, 5], np.int64), 3
    arguments = [mask, np.array(0, np.float32), np.array(-np.inf, np.float32), lengths,
                 np.array([queries]), np.arange(3).reshape(3, 1), np.arange(6).reshape(1, 6),
                 np.arange(6).reshape(1, 6)]
    out = tvm.runtime.empty((2, 1, 3, 6), "float32")
    library["main"](*[tvm.runtime.tensor(a) for a in arguments], out)
    q, k = np.arange(3)[:, None], np.arange(6)[None, :]
    allowed = mask[:, 0] & (q + lengths[:, None, None] - queries >= k) & (k < lengths[:, None, None])
    np.testing.assert_array_equal(out.numpy()[:, 0], np.where(allowed, 0, -np.inf).astype(np.float32))
