"""Titan's Triton kernels compile for CUDA GPUs on a machine without one (``triton.compile`` for a ``GPUTarget``:
Triton IR, PTX and, with the ``ptxas`` Triton ships, a cubin), and fit the target's shared memory per block.

What this cannot check: that they run (no launch without a device). Triton checks shared memory against the
device only at launch (``OutOfResources``), so the compiled kernel's ``shared`` is checked here against the limit
of the target (CUDA C Programming Guide, technical specifications per compute capability: at most 227 KiB per
block on 9.0, 163 KiB on 8.0, 99 KiB on 8.6/8.9). The test process runs Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1`` with no GPU, and ``@triton.jit`` reads it at import), so the compiler runs in a
subprocess with the interpreter off. fp32 inputs are in the slow tier only: an fp32 kernel (IEEE dots) takes
10-60 s to compile here (minutes at 128 x 128 blocks, where the dK/dV kernel did not fit sm_90: 264192 bytes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024, 86: 99 * 1024}

SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import titan_ds.kernels._attention_triton as K

POINTERS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}  # the input dtype
FP32_POINTERS = {"LSE", "DELTA"}
INTS = {"H", "TQ", "TK", "D"}


def signature(fn, dtype, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*" + dtype
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name == "KPM":
            sig[name] = "*i8"
        elif name == "sm_scale":
            sig[name] = "fp32"
        elif name in INTS or name.startswith("s_"):
            sig[name] = "i32"
        else:
            raise SystemExit(f"{fn.__name__}: argument {name!r} of unknown type; teach this test its type")
    return sig


out = []
for kernel, dtype, head_dim, cc in json.loads(sys.argv[1]):
    fn = getattr(K, kernel)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    bm, bn, bd = K.block_sizes(128, head_dim, torch_dtype)  # the default tile (TiledAttention, tiled_attention)
    const = dict(CAUSAL=True, HAS_KPM=True, PREC="ieee" if dtype == "fp32" else "tf32", BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_D=bd)
    ck = triton.compile(ASTSource(fn=fn, signature=signature(fn, dtype, const), constexprs=const),
                        target=GPUTarget("cuda", cc, 32))
    out.append(dict(kernel=kernel, dtype=dtype, head_dim=head_dim, cc=cc, asm=sorted(ck.asm),
                    shared=ck.metadata.shared, blocks=[bm, bn, bd]))
print(json.dumps(out))
"""


def _compile(cases: list[tuple[str, str, int, int]], tmp_path: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # compile every time, not from a cache
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _check(results: list[dict]) -> None:
    for r in results:
        assert {"ttir", "ttgir", "ptx", "cubin"} <= set(r["asm"]), r
        assert r["shared"] <= SHARED_LIMIT[r["cc"]], \
            f"{r['kernel']} {r['dtype']} head dim {r['head_dim']} blocks {r['blocks']}: {r['shared']} bytes of " \
            f"shared memory, sm_{r['cc']} allows {SHARED_LIMIT[r['cc']]} per block (OutOfResources at launch)"


def test_attention_forward_compiles_for_sm90(tmp_path):
    """The bf16 forward kernel at the default tile and head dim 64, for an H100/H200 (sm_90)."""
    _check(_compile([("_fwd_kernel", "bf16", 64, 90)], tmp_path))


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("cc", [90, 80])
def test_attention_kernels_compile_bf16(cc, tmp_path):
    """Forward, dK/dV and dQ, bf16, head dims 32/64/128 at the default tile, for sm_90 and sm_80."""
    _check(_compile([(k, "bf16", d, cc) for k in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
                     for d in (32, 64, 128)], tmp_path))


@pytest.mark.slow
@pytest.mark.heavy
def test_attention_kernels_compile_fp32(tmp_path):
    """fp32 at head dim 64 (the fp32 block cap of 64: 128 x 128 blocks needed more shared memory than sm_90 has)."""
    _check(_compile([(k, "fp32", 64, cc) for k in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
                     for cc in (90, 80)], tmp_path))
