"""tools/kernel_resources.py: what ptxas reports per decode kernel, GPU-free (NVRTC only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_kernels_compile import _nvrtc_ok

_spec = importlib.util.spec_from_file_location(
    "kernel_resources", Path(__file__).parents[1] / "tools" / "kernel_resources.py"
)
kr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kr)


LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size, 128 bytes smem
"""


def test_ptxas_log_and_occupancy_arithmetic():
    r = kr.ptxas_resources(LOG)
    assert r == {"registers": 64, "frame": 8, "spill_stores": 12, "spill_loads": 16, "static_smem": 128}
    with pytest.raises(ValueError, match="Used N registers"):
        kr.ptxas_resources("ptxas info    : 0 bytes gmem\n")
    # 320 threads at 64 registers: 3 blocks by registers (65536 / (10 warps x 2048)); 61 KB of
    # shared memory: 3 of 228 KB; at 78 registers (2560 a warp) only 2
    assert kr.blocks_per_sm(64, 320, 61440, "9.0") == 3
    assert kr.blocks_per_sm(78, 320, 61440, "9.0") == 2
    assert kr.blocks_per_sm(64, 320, 116 * 1024, "9.0") == 1
    assert kr.blocks_per_sm(32, 1024, 0, "8.6") == 1  # 1536 threads an SM
    # one block beside another: registers per warp in units of 256 (80 x 32 = 2560 for a 77-register
    # thread), a 640-thread block at 58 registers (64 x 32 x 20 = 40960) plus a 320-thread one at 77
    # (25600) is 66560 > 65536; at 64 registers the second fits (20480)
    assert kr.beside((58, 640, 121 * 1024), (77, 320, 60 * 1024), "9.0") == "regs 66560"
    assert kr.beside((58, 640, 121 * 1024), (64, 320, 60 * 1024), "9.0") == "yes"
    assert kr.beside((40, 640, 170 * 1024), (40, 320, 60 * 1024), "9.0") == "smem"
    assert kr.beside((32, 1024, 0), (32, 1024, 0), "8.6") == "threads"
    mix = kr.mixed_dtypes("q4_k_m", 4)
    assert mix["wv@0"] == mix["w_down@2"] == "q6_k" and "wv@1" not in mix and mix["wv"] == "q4_k"
    assert kr.mixed_dtypes("q8_0", 4) == {}


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC or CUDA headers not available")
def test_tool_lists_every_decode_kernel_of_a_plan(capsys):
    assert kr.main(["--family", "llama", "--shape", "smollm2-135m", "--quant", "q4_1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("smollm2-135m q4_1 on h200 (sm_90a, cc 9.0), mode decode1:")
    rows = [line.split() for line in out[3:]]
    assert len(rows) == int(out[0].split(": ")[1].split()[0]) and len(rows) >= 4
    assert all(0 < int(r[-7]) <= 255 and int(r[-5]) in (32, 64, 128, 256, 320, 512, 640, 1024) and int(r[-3]) >= 1 for r in rows)
    assert all(r[-2] in ("yes", "smem", "threads", "-") or r[-2].startswith("regs") for r in rows)
    assert sum(r[-2] == "-" for r in rows) <= 1  # only the pass's last kernel has no next one
    assert any(r[-1].startswith("gemv__quantq41r") for r in rows)
    # k-quants need 256-element rows: SmolLM2's 576 has no q4_k_m plan, said in one line
    assert kr.main(["--family", "llama", "--shape", "smollm2-135m", "--quant", "q4_k_m"]) == 2
    assert "smollm2-135m q4_k_m: no plan:" in capsys.readouterr().err
