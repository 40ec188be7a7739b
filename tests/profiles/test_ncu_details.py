"""ncu's `--set full --csv --page details` output: parsing a real H200 capture, grouping by kernel ID, and malformed
input (`mpfa profile ncu-details` in tests/mpfa_cli/commands/test_profile_cli.py)."""
from pathlib import Path

import pytest

from mpfa.mpfa_cli.errors import ToolError
from mpfa.profiles.ncu_details import NcuRule, bound_summary, parse_details

FIXTURES = Path(__file__).parents[1] / "fixtures" / "profiles"
# Real output from the H200: a one-warpgroup wgmma prefill at 16K, 32:8 heads, one warm launch.
ONE_WARPGROUP = FIXTURES / "ncu-details-prefill-16k-mpfa-one-warpgroup-h200.csv"
# The same kernel after its K / V expansion was made free of bank conflicts (`mpfa profile prefill --ncu-full`).
ONE_WARPGROUP_CONFLICT_FREE = FIXTURES / "ncu-details-prefill-16k-mpfa-one-warpgroup-conflict-free-h200.csv"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type",'
          '"Rule Description","Estimated Speedup Type","Estimated Speedup"')


def _metric(kernel_id: int, name: str, section: str, metric: str, unit: str, value: str) -> str:
    return (f'"{kernel_id}","1","python3","127.0.0.1","{name}","1","7","(64, 1, 1)","(32, 2, 1)","0","9.0",'
            f'"{section}","{metric}","{unit}","{value}",')  # ncu ends metric rows after the value, with a comma


def _rule(kernel_id: int, name: str, section: str, rule: str, description: str, speedup: str) -> str:
    return (f'"{kernel_id}","1","python3","127.0.0.1","{name}","1","7","(64, 1, 1)","(32, 2, 1)","0","9.0",'
            f'"{section}","","","","{rule}","OPT","{description}","global","{speedup}"')


def test_parse_real_h200_capture():
    text = ONE_WARPGROUP.read_text()
    assert text.startswith("==WARNING==") and "==PROF== Disconnected" in text  # ncu's own lines come first
    [kernel] = parse_details(text)
    assert "PrefillSm90Wgmma" in kernel.kernel
    assert (kernel.block, kernel.grid) == ((128, 1, 1), (1024, 8, 1))
    m = kernel.metrics
    assert m["GPU Speed Of Light Throughput", "DRAM Frequency"] == ("hz", 3_199_487_144.24)
    assert m["GPU Speed Of Light Throughput", "Duration"] == ("ns", 8_147_840)
    assert m["Launch Statistics", "Registers Per Thread"] == ("register/thread", 151)
    assert m["Compute Workload Analysis", "Issue Slots Busy"] == ("%", 45.45)
    assert m["Scheduler Statistics", "Eligible Warps Per Scheduler"] == ("warp", 0.61)
    assert m["Occupancy", "Block Limit Shared Mem"] == ("block", 2)
    assert m["Instruction Statistics", "Executed Instructions"] == ("inst", 3_542_172_096)
    # Same metric name in two sections, kept apart; texts stay texts.
    assert m["Memory Workload Analysis", "Memory Throughput"] == ("byte/s", 21_962_925_143.35)
    assert m["GPU Speed Of Light Throughput", "Memory Throughput"] == ("%", 65.03)
    assert m["Launch Statistics", "Cluster Scheduling Policy"] == ("", "PolicySpread")
    assert m["Launch Statistics", "Enabled TPC IDs"] == ("", "all")
    assert len(m) == 87 and len(kernel.rules) == 12
    [conflicts] = [rule for rule in kernel.rules if rule.name == "SharedMemoryConflicts"]
    assert (conflicts.section, conflicts.speedup) == ("MemoryWorkloadAnalysis_Tables", 27.44)
    assert "10.2 - way bank conflict" in conflicts.description
    assert NcuRule("SpeedOfLight", "SOLBottleneck", None, kernel.rules[0].description) == kernel.rules[0]


def test_bound_summary_of_the_real_capture():
    [kernel] = parse_details(ONE_WARPGROUP.read_text())
    summary = dict(bound_summary(kernel))
    assert summary == {
        "launch": "grid (1024, 8, 1), block (128, 1, 1)",
        "duration": "8.148 ms",
        "SM (compute) throughput": "45.45%",
        "memory throughput": "65.03% (highest L1/TEX: L1/TEX 65.27%, L2 15.86%, DRAM 0.46%)",
        "issue slots busy": "45.45%",
        "active warps per scheduler": "2.00",
        "eligible warps per scheduler": "0.61",
        "cycles with no eligible warp": "54.41%",
        "warp cycles per issued instruction": "4.38",
        "occupancy, theoretical / achieved": "12.50% / 12.49%",
        "occupancy limiter": "shared memory: 2 blocks per SM (block limits: registers 3, shared memory 2, warps 16, "
                             "SM 32, barriers 32)",
        "registers per thread": "151",
        "dynamic shared memory per block": "102,400 B (100.0 KiB)",
        "executed instructions": "3,542,172,096",
        "shared-memory bank conflicts": "shared stores: 10.2-way, 42.04% of the wavefronts are bank conflicts "
                                        "(estimated speedup 27.44%)",
        "excess shared-memory wavefronts": "24% (304,218,112 of 1,265,303,018)",
    }


def test_the_conflict_free_expansion_in_a_real_capture():
    """The capture after the conflict-free expansion: no conflict rule, 3% excess wavefronts."""
    [kernel] = parse_details(ONE_WARPGROUP_CONFLICT_FREE.read_text())
    summary = dict(bound_summary(kernel))
    assert summary["shared-memory bank conflicts"] == "none reported (ncu's rule did not fire)"
    assert summary["excess shared-memory wavefronts"] == "3% (34,734,080 of 995,818,610)"
    assert summary["executed instructions"] == "3,331,880,704"


def test_two_kernels_are_grouped_by_id():
    """Two launches of one kernel (--launch-count 2), rows interleaved: each ID keeps its own metrics and rules;
    what a kernel lacks reads n/a."""
    text = "\n".join([
        "==PROF== Connected to process 7 (/usr/bin/python3)", "", HEADER,
        _metric(0, "k", "GPU Speed Of Light Throughput", "Duration", "usecond", "1,500.50"),
        _metric(1, "k", "GPU Speed Of Light Throughput", "Duration", "ns", "2,000"),
        _metric(0, "k", "Occupancy", "Block Limit Registers", "block", "4"),
        _metric(0, "k", "Occupancy", "Block Limit Warps", "block", "4"),
        _metric(0, "k", "Occupancy", "Block Limit Shared Mem", "block", "8"),
        _rule(1, "k", "MemoryWorkloadAnalysis_Tables", "SharedMemoryConflicts",
              "The memory access pattern for shared loads might not be optimal and causes on average a 4.0 - way "
              "bank conflict across all 10 shared load requests.This results in 30 bank conflicts,  which represent "
              "75.00% of the overall 40 wavefronts for shared loads.", "12.5"),
        _metric(1, "k", "Launch Statistics", "Dynamic Shared Memory Per Block", "Kbyte/block", "49.15"),
    ])
    a, b = parse_details(text)
    assert a.kernel == b.kernel == "k"
    assert (a.block, a.grid) == ((64, 1, 1), (32, 2, 1))
    assert set(a.metrics) == {("GPU Speed Of Light Throughput", "Duration"), ("Occupancy", "Block Limit Registers"),
                              ("Occupancy", "Block Limit Warps"), ("Occupancy", "Block Limit Shared Mem")}
    assert a.rules == [] and [rule.speedup for rule in b.rules] == [12.5]
    first, second = dict(bound_summary(a)), dict(bound_summary(b))
    assert first["duration"] == "1.500 ms" and second["duration"] == "0.002 ms"
    assert first["occupancy limiter"] == ("registers and warps: 4 blocks per SM (block limits: registers 4, "
                                          "shared memory 8, warps 4)")
    assert first["shared-memory bank conflicts"] == first["excess shared-memory wavefronts"] == \
        "none reported (ncu's rule did not fire)"
    assert first["registers per thread"] == first["memory throughput"] == "n/a"
    assert first["occupancy, theoretical / achieved"] == "n/a / n/a"
    assert second["occupancy limiter"] == "n/a"
    assert second["dynamic shared memory per block"] == "49,150 B (48.0 KiB)"
    assert second["shared-memory bank conflicts"] == ("shared loads: 4.0-way, 75.00% of the wavefronts are bank "
                                                      "conflicts (estimated speedup 12.50%)")


@pytest.mark.parametrize("text,message", [
    ("==PROF== Disconnected from process 1\n", "no CSV header"),
    ('"ID","Kernel Name","gpu__time_duration.sum"\n"0","k","1"\n',
     "not an ncu details page: the CSV header lacks 'Block Size', 'Grid Size', 'Section Name', 'Metric Name', "
     "'Metric Unit', 'Metric Value'"),
    (HEADER + "\n", "ncu's CSV has a header but no kernel rows"),
    ("\n".join([HEADER, _metric(0, "a", "Occupancy", "Block Limit SM", "block", "32"),
                _rule(1, "b", "Occupancy", "TheoreticalOccupancy", "limited by shared memory", "30")]),
     "kernel ID 1 (b) has no metric rows"),
])
def test_malformed_input_is_a_one_line_tool_error(text, message):
    with pytest.raises(ToolError) as error:
        parse_details(text)
    assert message in str(error.value) and "\n" not in str(error.value)

