"""bench/decode.py's decode-step breakdown, on synthetic profiler events (the GPU run is in bench/)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import SHAPES, full_config, linear_params  # noqa: E402
import decode  # noqa: E402
from decode import (decode_breakdown, engine_linears, kernel_time_by_group, label_groups,  # noqa: E402
                    short_kernel_name, split_by_predecessor)


def kernel(name: str, start: float, end: float, grid=(1, 1, 1)) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "args": {"grid": list(grid)}}


def test_short_kernel_names():
    assert short_kernel_name("void ocria_rt::cuda::(anonymous namespace)::skinny_gemm_kernel<8, 1, 2, 4, false, "
                             "false, __nv_bfloat16>(__nv_bfloat16 const*, long)") == \
        "skinny_gemm_kernel<8, 1, 2, 4, false, false, __nv_bfloat16>"
    assert short_kernel_name("ocria_rt::(anonymous namespace)::increment_kernel(int*, long)") == "increment_kernel"
    assert short_kernel_name("void cutlass::device_kernel<cutlass::gemm::X<a::b>>(p)") == "device_kernel<cutlass::gemm::X<a::b>>"


def test_critical_path_counts_overlap_once_and_idle_apart():
    events = [kernel("void ns::a(int)", 0, 10, (4, 1, 1)),
              kernel("void ns::b(int)", 5, 20),        # overlaps a (PDL): only 10..20 is its own
              kernel("void ns::d(int)", 12, 15),       # inside b: nothing of its own
              kernel("void ns::c(int)", 25, 30),       # after 5 us with no kernel
              kernel("void ns::a(int)", 30, 40, (4, 1, 1)),
              kernel("void ns::a(int)", 40, 41, (8, 1, 1)),  # another grid: another group
              {"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 100}]
    groups, idle, gaps = kernel_time_by_group(events)
    a = groups[("a", (4, 1, 1))]
    assert (a["calls"], a["us"], a["crit_us"]) == (2, 20.0, 20.0)
    # by the kernel that started before: the first a after none, the second after c
    assert a["before"] == {"": {"calls": 1, "us": 10.0, "crit_us": 10.0}, "c": {"calls": 1, "us": 10.0, "crit_us": 10.0}}
    assert set(groups[("d", (1, 1, 1))]["before"]) == {"b"}
    assert groups[("b", (1, 1, 1))]["crit_us"] == 10.0 and groups[("b", (1, 1, 1))]["us"] == 15.0
    assert groups[("d", (1, 1, 1))]["crit_us"] == 0.0
    assert groups[("c", (1, 1, 1))]["crit_us"] == 5.0 and groups[("a", (8, 1, 1))]["calls"] == 1
    assert idle == 5.0
    assert gaps == {("b", "c"): 5.0}  # b's end, not d's (which started later but ended first), was the front
    assert sum(g["crit_us"] for g in groups.values()) + idle == 41.0  # the span, first start to last end


def test_engine_linears_are_every_projection_once():
    for shape in SHAPES.values():
        c = full_config(shape)
        assert sum(l["N"] * l["K"] * l["count"] for l in engine_linears(c)) == linear_params(c)


N2560 = "attn o / gdn out / mlp down"


def test_block_tiles_of_two_row_tiles_count_32_rows():
    """RT = 2 (OCRIA_RT_SKINNY_ROWS=32): a grid of N / 32 blocks is gate_up's (1152 row tiles of 16)."""
    c = full_config(SHAPES["ocria1-4b"])
    rows = [{"kernel": "skinny_gemm_kernel<8, 2, 1, 4, true, false, true, false, 1, false, 2, __nv_bfloat16>",
             "grid": [576, 1, 1]}]
    label_groups(rows, c, 1024)
    assert rows[0]["work"] == "mlp gate_up"


# The template arguments GLU, ADD, NORM of each kind of linear (bench/decode.py, engine_linears).
ADD, NORM, GLU_NORM, PLAIN = "false, true, false", "false, false, true", "true, false, true", "false, false, false"


@pytest.mark.parametrize("grid,epi,cs,work", [((160, 1, 1), ADD, 1, N2560),
                                              ((640, 1, 1), ADD, 4, N2560),  # not attn qkv's 640 tiles
                                              ((1152, 1, 1), GLU_NORM, 1, "mlp gate_up"),
                                              ((1152, 1, 1), PLAIN, 1, ""), ((160, 1, 1), GLU_NORM, 1, ""),
                                              ((15520, 1, 1), PLAIN, 1, "lm_head"), ((999, 1, 1), PLAIN, 1, "")])
def test_skinny_gemm_groups_get_their_linears_bytes(grid, epi, cs, work):
    c = full_config(SHAPES["ocria1-4b"])
    rows = [{"kernel": f"skinny_gemm_kernel<16, 1, 2, 3, {epi}, false, {cs}, false, 1, __nv_bfloat16>", "grid": list(grid)},
            {"kernel": "gdn_decode_kernel<128>", "grid": [32, 1, 1]}]
    label_groups(rows, c, 1024)
    assert rows[0]["work"] == work
    want = {N2560: 2 * 2560 * 4096 * 32 + 2 * 2560 * 9216 * 32,
            "mlp gate_up": 2 * 18432 * 2560 * 32, "lm_head": 2 * 248320 * 2560, "": None}[work]
    assert rows[0]["bytes_per_step"] == want
    assert rows[1]["work"].startswith("DeltaNet") and rows[1]["bytes_per_step"] > 0


@pytest.mark.parametrize("epi,calls,work", [(NORM, 32, {"gdn in_proj", "attn qkv"}),
                                            (NORM, 24, {"gdn in_proj"}),
                                            (PLAIN, 1, {"lm_head"}),
                                            (GLU_NORM, 32, {"mlp gate_up"}),
                                            (GLU_NORM, 33, set()), (NORM, 50, set())])  # no subset
def test_persistent_skinny_gemm_groups_are_found_by_their_calls(epi, calls, work):
    """Persistent launches share one grid (the blocks that fit at once): the group is the one set of
    linears of the same kind (the same GLU, ADD and NORM) and at least that many tiles whose layer
    counts add up to its calls per step."""
    c = full_config(SHAPES["ocria1-4b"])
    rows = [{"kernel": f"skinny_gemm_kernel<8, 1, 2, 4, {epi}, false, 1, true, 1, __nv_bfloat16>", "grid": [396, 1, 1],
             "calls_per_step": calls}]
    label_groups(rows, c, 1024)
    assert set(filter(None, rows[0]["work"].split(" / "))) == work
    sizes = {"gdn in_proj": 2 * 12352 * 2560 * 24, "attn qkv": 2 * 10240 * 2560 * 8, "mlp gate_up": 2 * 18432 * 2560 * 32,
             "lm_head": 2 * 248320 * 2560}
    assert rows[0]["bytes_per_step"] == (sum(sizes[w] for w in work) if work else None)


def test_ncu_summary_groups_kernels_and_ranks_stalls():
    """bench/ncu_step.py's reading of an ncu --csv --page raw log: messages before the header, a
    units row, kernels grouped by (name, grid), ns -> us, the largest stall reasons first."""
    from ncu_step import ncu_rows, summary_rows

    stall, per = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "Grid Size", "gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
              stall + "long_scoreboard" + per, stall + "barrier" + per, stall + "wait" + per]
    units = ["", "", "", "nsecond", "%", "", "", ""]
    k1 = "void ocria_rt::cuda::(anonymous namespace)::rms_norm_kernel<__nv_bfloat16, 8, true>(__nv_bfloat16*, int)"
    k2 = "void ocria_rt::cuda::(anonymous namespace)::gdn_decode_kernel<128>(const __nv_bfloat16*, long)"
    data = [["0", k1, "(1, 1, 1)", "2000", "1.5", "9.0", "3.0", "1.0"],
            ["1", k2, "(32, 1, 1)", "5000", "10", "2.0", "7.0", "4.0"],
            ["2", k1, "(1, 1, 1)", "3000", "2.5", "8.0", "2.0", "1.0"]]
    text = "==PROF== Connected to process 1\n" + "\n".join(",".join(f'"{c}"' for c in r) for r in [header, units] + data)
    table = summary_rows(*ncu_rows(text))
    assert [r["kernel"] for r in table] == ["rms_norm_kernel<__nv_bfloat16, 8, true>", "gdn_decode_kernel<128>"]
    norm = table[0]
    assert norm["calls"] == 2 and norm["us"] == 2.5 and norm["total us"] == 5.0 and norm["DRAM BW %"] == 2.0
    assert norm["top stalls (per issue)"] == "long_scoreboard 8.5, barrier 2.5, wait 1.0"
    assert table[1]["top stalls (per issue)"].startswith("barrier 7.0")


def test_ncu_source_report_ranks_instructions_by_samples():
    """bench/ncu_step.py source: per section of ncu's --page source --csv export, the executed
    instructions summed, the stall reasons as shares of the samples, the hottest instructions in
    program order with their two largest reasons."""
    from ncu_step import source_report

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_barrier", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
    rows = [["0x0", "  LDG.E R2, [R4.64]", "10", "512", "0", "0", "10", "0"],
            ["0x10", "  BAR.SYNC 0x0", "60", "512", "50", "5", "5", "40"],
            ["0x20", "  FFMA R1, R2, R3, R1", "30", "1024", "0", "30", "0", "30"]]
    kernel = "void ocria_rt::cuda::(anonymous namespace)::gdn_decode_kernel<128, 128, 4>(float*)"
    section = lambda k, rs: "\n".join(",".join(f'"{c}"' for c in r) for r in [["Kernel Name", k], header] + rs)
    text = section(kernel, rows) + "\n" + section(kernel.replace("gdn_decode", "attention_decode"), rows[:1])
    report = source_report(text, top=2)
    first, second = report.split("### ")[1:]
    assert first.startswith("gdn_decode_kernel<128, 128, 4>")
    assert "2048 warp instructions executed, 100 stall samples: barrier 50%, long_sb 35%, wait 15%" in first
    assert "LDG.E" not in first  # not among the top 2
    assert first.index("BAR.SYNC") < first.index("FFMA")  # program order
    assert "| 1 | BAR.SYNC 0x0 | 60.0 | 512 | barrier 50, wait 5 |" in first
    assert "| 2 | FFMA R1, R2, R3, R1 | 30.0 | 1024 | long_sb 30 |" in first
    assert second.startswith("attention_decode_kernel") and "wait 100%" in second


def test_one_kernel_for_three_projections_splits_by_the_kernel_before_it():
    """The 4B's o_proj, out_proj and down are one kernel on one grid (cluster split-K, 320 blocks):
    their row splits into one row per linear by what ran before each call, each with its own bytes."""
    c = full_config(SHAPES["ocria1-4b"])
    part = lambda calls, crit: {"calls_per_step": calls, "us_per_step": 2.0 * crit, "crit_us_per_step": crit}
    rows = [{"kernel": f"skinny_gemm_kernel<8, 1, 2, 4, {ADD}, false, 2, false, 1, __nv_bfloat16>",
             "grid": [320, 1, 1], "calls_per_step": 64, "us_per_step": 1300.0, "crit_us_per_step": 650.0,
             "parts": {"attention_decode_kernel": part(8, 80.0), "gdn_decode_kernel": part(24, 240.0),
                       "skinny_gemm_kernel": part(32, 330.0)}},
            {"kernel": "gdn_decode_kernel<128>", "grid": [32, 1, 1], "calls_per_step": 24, "us_per_step": 290.0,
             "crit_us_per_step": 146.0, "parts": {"skinny_gemm_kernel": part(24, 146.0)}}]
    label_groups(rows, c, 1024)
    assert rows[0]["work"] == N2560
    split = split_by_predecessor(rows, c)
    by_work = {r["work"]: r for r in split}
    assert set(by_work) == {"attn o", "gdn out", "mlp down", "DeltaNet (state in and out)"}
    assert by_work["attn o"]["crit_us_per_step"] == 80.0 and by_work["attn o"]["calls_per_step"] == 8
    assert by_work["attn o"]["bytes_per_step"] == 2 * 2560 * 4096 * 8
    assert by_work["gdn out"]["bytes_per_step"] == 2 * 2560 * 4096 * 24
    assert by_work["mlp down"]["bytes_per_step"] == 2 * 2560 * 9216 * 32
    assert sum(r["bytes_per_step"] for r in split[:3]) == rows[0]["bytes_per_step"]
    # a predecessor that fits none of them (the unfused attention's combine kernel fits "attention"),
    # or two linears behind one kind of kernel: the row stays whole
    rows[0]["parts"]["embedding_kernel"] = part(1, 5.0)
    assert [r["work"] for r in split_by_predecessor(rows, c)][0] == N2560


def test_decode_breakdown_takes_the_prefill_out_and_divides_by_the_steps(monkeypatch):
    """decode_breakdown on a stand-in engine and profiler: a generate of 1 token (prefill, one DeltaNet
    kernel) and one of 1 + 2 tokens (two decode steps of a 3 us DeltaNet kernel and a 1 us embedding
    each, 1 us apart); per step, the prefill's kernels taken out; the step's wall time from the
    longer run's decode rate."""
    gdn, emb = "void ocria_rt::cuda::gdn_decode_kernel<128>(float*)", "void ocria_rt::cuda::embedding_kernel<int>(int*)"
    traces = {1: [kernel(gdn, 0, 10, (32, 1, 1))],
              3: [kernel(gdn, 0, 10, (32, 1, 1)),
                  kernel(emb, 11, 12), kernel(gdn, 12, 15, (32, 1, 1)),
                  kernel(emb, 16, 17), kernel(gdn, 17, 20, (32, 1, 1))]}

    class Result:
        def __init__(self, n: int) -> None:
            self.decode_tokens_per_second = 250_000.0 if n == 3 else 1.0

    class Engine:
        def __init__(self) -> None:
            self.last = 0

        def generate(self, prompt, max_new_tokens, stop_token_ids):
            self.last = max_new_tokens
            return Result(max_new_tokens)

    eng = Engine()

    def fake_trace(fn):
        fn()
        return traces[eng.last]

    monkeypatch.setattr(decode, "profiled_trace_events", fake_trace)
    c = full_config(SHAPES["ocria1-4b"])
    b = decode_breakdown(eng, list(range(16)), 2, c, bw=4e12)
    assert b["steps"] == 2 and b["wall_us_per_step"] == 4.0
    rows = {r["kernel"]: r for r in b["groups"]}
    assert set(rows) == {"gdn_decode_kernel<128>", "embedding_kernel<int>"}
    g = rows["gdn_decode_kernel<128>"]
    assert g["calls_per_step"] == 1 and g["crit_us_per_step"] == 3.0 and g["work"].startswith("DeltaNet")
    assert g["ideal_us_per_step"] > 0 and g["excess_us_per_step"] == 3.0 - g["ideal_us_per_step"]
    assert rows["embedding_kernel<int>"]["crit_us_per_step"] == 1.0
    assert b["idle_us_per_step"] == 1.0 and b["kernels_per_step"] == 2
    # the two 1 us gaps: prefill -> first step, then between the steps
    assert b["idle_gaps"] == [{"after": "gdn_decode_kernel", "before": "embedding_kernel", "us_per_step": 1.0}]
    table = decode.breakdown_table(b)
    assert "gdn_decode_kernel -> embedding_kernel" in table and "| idle (no kernel running) |" in table
