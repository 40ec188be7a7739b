"""ncu's `--csv --page source --print-source sass` output: parsing real H200 captures, the hot-loop partition of a
warp-specialised prefill and a split-KV decode, synthetic pages (nesting, several kernels, malformed input)
(`mpfa profile ncu-source` in tests/mpfa_cli/commands/test_profile_cli.py)."""
from pathlib import Path

import pytest

from mpfa.mpfa_cli.errors import ToolError
from mpfa.profiles.ncu_source import (UNATTRIBUTED, UNKNOWN_PRODUCER, hot_loops, loop_spans, parse_source_csv,
                                      read_text, scoreboard_producers)

FIXTURES = Path(__file__).parents[1] / "fixtures"
# H200: `--set full`, then `--import R --csv --page source --print-source sass`.
PRODUCER = FIXTURES / "ncu-source-prefill-16k-mpfa-producer-warpgroup-h200.csv.gz"  # producer loop + consumer loop
LANE_MAJOR_V = FIXTURES / "ncu-source-decode-128k-b8-mpfa-split-kv-lane-major-v-h200.csv.gz"  # one warp per CTA
# H100 (the same commands): an fp8 prefill build, a persistent kernel (one outermost loop)
DS_AFTER_QK_WAIT = FIXTURES / "ncu-source-prefill-16k-mpfa-ds-after-qk-wait-h100.csv.gz"
REASONS = ("barrier", "long_sb", "selected", "short_sb", "wait")
HEADER = ",".join(f'"{column}"' for column in (
    "Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
    "# Samples", "Instructions Executed", *(f"stall_{reason}" for reason in REASONS),
    *(f"stall_{reason} (Not Issued)" for reason in REASONS)))


def _row(address: int, sass: str, executed: int, **stalls: int) -> str:
    """One instruction row; its samples are the sum of `stalls`."""
    samples = sum(stalls.values())
    counts = [stalls.get(reason, 0) for reason in REASONS]
    return ",".join(f'"{cell}"' for cell in (
        f"{0x7f0000000000 + address:#x}", f"      {sass}", samples, 0, samples, executed, *counts, *[0] * len(REASONS)))


def _page(kernel: str, *rows: str) -> str:
    return "\n".join([f'"Kernel Name","{kernel}",', HEADER, *rows])


def _shares(loop) -> list[tuple[str, int]]:
    return [(reason, round(share)) for reason, share in loop.stalls[:4]]


def test_parse_the_producer_warpgroup_capture():
    [page] = parse_source_csv(read_text(PRODUCER))
    assert "prefill_wgmma_wsPrefillSm90WgmmaWsUnscaled" in page.kernel
    assert len(page.instructions) == 3712
    first = page.instructions[0]
    assert (first.address, first.sass, first.executed, first.samples) == (
        0x7f08577c1200, "LDC R1, c[0x0][0x28]", 49152, 147)
    assert first.stalls == {"no_inst": 146, "not_selected": 1}
    assert sum(instruction.samples for instruction in page.instructions) == 552_379
    assert all(sum(instruction.stalls.values()) == instruction.samples for instruction in page.instructions)
    # ncu's reason columns miss some samples only on the wgmma instructions.
    unattributed = [instruction for instruction in page.instructions if UNATTRIBUTED in instruction.stalls]
    assert len(unattributed) == 4 and all(instruction.sass.startswith("QGMMA.") for instruction in unattributed)
    assert sum(instruction.stalls[UNATTRIBUTED] for instruction in unattributed) == 8_776


def test_producer_warpgroup_hot_loops_are_the_producer_and_the_consumer_loop():
    [page] = parse_source_csv(read_text(PRODUCER))
    assert loop_spans(page) == [(944, 1390), (1439, 1872), (1876, 1879), (2456, 2948), (2955, 3366), (3699, 3699)]
    kernel = hot_loops(page)
    assert kernel.samples == 552_379
    producer, consumer = kernel.loops
    assert (producer.rows, producer.instructions, producer.executions) == ((1439, 1872), 434, 2_088_960)
    assert producer.share == pytest.approx(100 * 177_896 / 552_379)
    assert _shares(producer) == [("short_sb", 32), ("selected", 20), ("wait", 18), ("not_selected", 11)]

    assert (consumer.rows, consumer.instructions, consumer.executions) == ((2955, 3366), 412, 4_177_920)
    assert consumer.offsets == (0x7f08577ccab0 - 0x7f08577c1200, 0x7f08577ce460 - 0x7f08577c1200)
    assert consumer.share == pytest.approx(100 * 351_128 / 552_379)
    assert _shares(consumer) == [("selected", 20), ("barrier", 16), ("not_selected", 15), ("wait", 15)]
    # the two wgmma waits, then the consumers' spin on the producer's barrier (the 5-instruction inner loop)
    depbar, depbar_again, spin = consumer.hottest
    assert depbar.sass == depbar_again.sass == "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    assert (depbar.reason, round(depbar.share, 1), round(depbar_again.share, 1)) == ("barrier", 8.2, 7.7)
    assert (spin.sass, spin.reason) == ("@!P0 NANOSLEEP.SYNCS 0x989680", "long_sb")

    rest = kernel.rest
    assert (rest.rows, rest.executions, rest.instructions) == (None, None, 3712 - 434 - 412)
    assert producer.share + consumer.share + rest.share == pytest.approx(100)
    for loop in (producer, consumer, rest):
        assert sum(share for _, share in loop.stalls) == pytest.approx(100)
        assert len(loop.hottest) == 3


def test_decode_hot_loop_is_the_split_kv_loop():
    [page] = parse_source_csv(read_text(LANE_MAJOR_V))
    assert "SplitKVDecodeSm90Lean" in page.kernel and len(page.instructions) == 1936
    assert all(UNATTRIBUTED not in instruction.stalls for instruction in page.instructions)
    kernel = hot_loops(page)
    [loop] = kernel.loops
    assert (loop.rows, loop.instructions, loop.executions, round(loop.share, 1)) == ((1044, 1689), 646, 260_608, 98.0)
    assert _shares(loop) == [("short_sb", 23), ("long_sb", 18), ("mio", 16), ("wait", 14)]
    assert loop.hottest[0].sass == "LDS.128 R80, [R50+UR6+0x1400]"
    assert kernel.rest.instructions == 1936 - 646 and round(kernel.rest.share, 1) == 2.0


def test_decode_with_v_staged_key_major_and_the_exact_prefill():
    """Later captures: the decode with V staged key-major (the same loop, now waiting on memory: long scoreboard
    first) and the exact prefill kernel (one loop of 671 instructions, led by its two wgmma waits)."""
    [page] = parse_source_csv(read_text(FIXTURES / "ncu-source-decode-128k-b8-mpfa-split-kv-h200.csv.gz"))
    [loop] = hot_loops(page).loops
    assert loop.executions == 260_608 and loop.share > 95
    assert loop.stalls[0][0] == "long_sb" and loop.stalls[0][1] > 30
    [page] = parse_source_csv(read_text(FIXTURES / "ncu-source-prefill-16k-mpfa-exact-h200.csv.gz"))
    assert "PrefillSm90WgmmaDsCol" in page.kernel
    [loop] = hot_loops(page).loops
    assert (loop.instructions, loop.executions) == (671, 4_177_920) and loop.share > 95
    assert loop.stalls[0][0] == "barrier"
    assert [hot.sass for hot in loop.hottest[:2]] == ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 2


def test_fp8_prefill_waits_on_its_delta_s_loads_and_its_stages():
    """The fp8 prefill build's scoreboard stalls, by what they wait for: the staged Delta_S's LDS.128 (the scores'
    first FFMAs, read right after each QK wait) first, then the mbarrier tests of the operand stages; the producer
    loop of the producer-warpgroup kernel waits on its V transposes' LDSM."""
    [page] = parse_source_csv(read_text(DS_AFTER_QK_WAIT))
    assert "PrefillSm90WgmmaPre" in page.kernel and sum(i.samples for i in page.instructions) == 353_673
    [loop] = hot_loops(page).loops
    assert (loop.instructions, round(loop.share, 1)) == (2717, 99.6)
    producers = dict(loop.scoreboard)
    assert [opcode for opcode, _ in loop.scoreboard[:2]] == ["LDS.128", "SYNCS.PHASECHK"]
    assert round(producers["LDS.128"], 1) == 11.3 and round(producers["SYNCS.PHASECHK"], 1) == 9.2
    scoreboard = sum(share for reason, share in loop.stalls if reason in ("short_sb", "long_sb"))
    assert sum(producers.values()) == pytest.approx(scoreboard)
    ffma = next(i for i in page.instructions if i.sass == "FFMA R24, R124, R217, R156")
    assert scoreboard_producers([i for i in page.instructions if i.address <= ffma.address][-10:], wrap=False) == {
        "LDS.128": ffma.stalls["short_sb"]}
    [page] = parse_source_csv(read_text(PRODUCER))
    producer, _ = hot_loops(page).loops
    assert producer.scoreboard[0][0] == "LDSM.16" and round(producer.scoreboard[0][1]) == 16


def test_scoreboard_stalls_are_charged_to_the_nearest_variable_latency_writer():
    text = _page("k",
                 _row(0x00, "LDS.128 R4, [R2+0x10]", 8, selected=1),
                 _row(0x10, "MUFU.EX2 R9, R3", 8, selected=1),
                 _row(0x20, "FFMA R10, R5, R1, R9", 8, short_sb=6),    # R9: the MUFU, nearer than the LDS's R5
                 _row(0x30, "FADD R11, R7, R1", 8, short_sb=4),        # R7: the LDS.128's fourth register
                 _row(0x40, "MOV R9, R1", 8, selected=1),
                 _row(0x50, "FMUL R12, R9, R1", 8, short_sb=3),        # R9 rewritten by a MOV: no producer
                 _row(0x60, "FADD R3, R3, R12", 8, long_sb=2),         # R3 from the previous iteration's FADD
                 _row(0x70, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+0x8], R1", 8, selected=1),
                 _row(0x80, "@!P0 BRA 0x7f0000000000", 8, long_sb=5))  # P0: the mbarrier test
    [page] = parse_source_csv(text)
    [loop] = hot_loops(page).loops
    charged = scoreboard_producers(page.instructions)
    assert charged == {"MUFU.EX2": 6, "LDS.128": 4, UNKNOWN_PRODUCER: 5, "SYNCS.PHASECHK": 5}
    assert loop.scoreboard[0] == ("MUFU.EX2", pytest.approx(100 * 6 / 24))  # of the loop's 24 samples
    # searched back across the back edge only in a loop: the first FFMA's R5 written after it
    wrapped = _page("k", _row(0x00, "FFMA R10, R5, R1, R1", 8, short_sb=2), _row(0x10, "LDS R5, [R2]", 8, selected=1),
                    _row(0x20, "BRA 0x7f0000000000", 8, selected=1))
    [page] = parse_source_csv(wrapped)
    assert scoreboard_producers(page.instructions) == {"LDS": 2}
    assert scoreboard_producers(page.instructions, wrap=False) == {UNKNOWN_PRODUCER: 2}


@pytest.mark.parametrize("sass, written, read", [
    ("FFMA R5, R5, R6, R7", {"R5"}, {"R5", "R6", "R7"}),
    ("LDS.128 R156, [R218+0x8200]", {"R156", "R157", "R158", "R159"}, {"R218"}),
    ("LDSM.16.MT88.4 R4, [R2]", {"R4", "R5", "R6", "R7"}, {"R2"}),
    ("LDG.E.128 R80, desc[UR4][R80.64]", {"R80", "R81", "R82", "R83"}, {"R80", "R81"}),
    ("LDGSTS.E.BYPASS.128 [R5+0x100], desc[UR4][R8.64]", set(), {"R5", "R8", "R9"}),  # the addresses are read
    ("STSM.16.M88.4 [R3], R4", set(), {"R3", "R4"}),
    ("STS.64 [R3+0x10], R4", set(), {"R3", "R4"}),
    ("@!P1 SHFL.BFLY PT, R5, R4, 0x1, 0x1f", {"R5"}, {"P1", "R4"}),
    ("ISETP.GE.AND P2, PT, R233, UR28, PT", {"P2"}, {"R233"}),
    ("IADD3 R5, P0, PT, R3, 0x1, RZ", {"R5", "P0"}, {"R3"}),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R211+UR23], R92", {"P0"}, {"R211", "R92"}),
    ("@!PT LDS R1, [R2]", {"R1"}, {"R2"}),
    ("@UP0 FADD R1, R2, UR4", {"R1"}, {"R2"}),  # uniform registers are not tracked
    ("@!P0  BRA 0x7f85d77db0e0", set(), {"P0"}),
])
def test_sass_operands(sass, written, read):
    from mpfa.profiles.ncu_source import _operands

    assert _operands(sass)[1:] == (written, read)


def test_a_capture_of_two_kernels_gives_a_page_each():
    """Decode at 32K x 1, the split kernel and the merge in one report: the merge's loop waits on its loads."""
    split, merge = parse_source_csv(read_text(
        FIXTURES / "ncu-source-decode-32k-b1-mpfa-split-kv-and-merge-h200.csv.gz"))
    assert "SplitKVDecodeSm90Lean" in split.kernel and "DecodeMergeSm90" in merge.kernel
    [split_loop] = hot_loops(split).loops
    assert split_loop.instructions == 647 and split_loop.stalls[0][0] == "long_sb"
    [merge_loop] = hot_loops(merge).loops
    assert merge_loop.instructions == 71 and merge_loop.stalls[0][0] == "long_sb" and merge_loop.stalls[0][1] > 80


def test_nested_and_overlapping_loops_merge_and_cold_loops_fold_into_the_rest():
    text = _page("k",
                 _row(0x00, "MOV R1, R2", 1, selected=2),
                 _row(0x10, "IADD R1, R1, 1", 4, wait=10),                     # outer loop 1..5
                 _row(0x20, "@!P0 NANOSLEEP.SYNCS 0x989680", 40, long_sb=30),  # inner spin 2..3
                 _row(0x30, "@!P0  BRA 0x7f0000000020", 40, long_sb=20),
                 _row(0x40, "BRA.U !UP0, 0x7f0000000060", 4, wait=1),           # forward: no loop
                 _row(0x50, "@P0   BRA 0x7f0000000010", 4, selected=5),
                 _row(0x60, "ISETP.GE P0, R1, R2", 2, short_sb=4),              # 6..8 overlaps 7..9: one loop
                 _row(0x70, "MOV R3, R4", 2, barrier=3),
                 _row(0x80, "BRA 0x7f0000000060", 2, selected=1),
                 _row(0x90, "BRA.DIV UR4, 0x7f0000000070", 1, selected=1),
                 _row(0xa0, "EXIT", 1, selected=1),
                 _row(0xb0, "BRA 0x7f00000000b0", 0))                          # the trap: a cold loop
    [page] = parse_source_csv(text)
    assert loop_spans(page) == [(1, 5), (6, 9), (11, 11)]
    kernel = hot_loops(page)
    assert kernel.samples == 78
    outer, second = kernel.loops
    assert (outer.rows, outer.instructions, outer.executions) == ((1, 5), 5, 4)
    assert outer.share == pytest.approx(100 * 66 / 78)
    assert outer.stalls[0] == ("long_sb", pytest.approx(100 * 50 / 66))
    assert [(hot.sass, hot.reason) for hot in outer.hottest] == [
        ("@!P0 NANOSLEEP.SYNCS 0x989680", "long_sb"), ("@!P0 BRA 0x7f0000000020", "long_sb"),
        ("IADD R1, R1, 1", "wait")]
    assert (second.rows, second.instructions) == ((6, 9), 4)
    assert (kernel.rest.instructions, kernel.rest.share) == (3, pytest.approx(100 * 3 / 78))
    assert [hot.sass for hot in kernel.rest.hottest] == ["MOV R1, R2", "EXIT"]  # the unsampled trap is left out


def test_a_second_kernel_name_row_starts_a_new_kernel():
    text = "\n".join(["==PROF== Connected to process 7",
                      _page("first", _row(0x00, "NOP", 1, selected=1)),
                      _page("second", _row(0x00, "NOP", 1, wait=2), _row(0x10, "EXIT", 1, selected=1))])
    first, second = parse_source_csv(text)
    assert (first.kernel, len(first.instructions)) == ("first", 1)
    assert (second.kernel, [instruction.samples for instruction in second.instructions]) == ("second", [2, 1])
    assert second.instructions[0].stalls == {"wait": 2}


@pytest.mark.parametrize("text, message", [
    ("", 'not an ncu source page: no "Kernel Name" row'),
    (HEADER + "\n" + _row(0, "NOP", 1), 'not an ncu source page: it does not start with a "Kernel Name" row'),
    ('"Kernel Name","k"\n"Address","Source","Instructions Executed"\n',
     "not an ncu source page: the CSV header lacks 'Warp Stall Sampling (All Samples)', 'stall_* reasons'"),
    (_page("k"), "kernel k has no instruction rows"),
    (_page("k", _row(0, "NOP", 1)).replace('"0x7f0000000000"', '"here"'),
     "instruction row 0: address 'here' is not hexadecimal"),
    (_page("k", _row(0x00, "NOP", 1), _row(0x10, "BRA 0x7f0000000008", 1)),
     "k: 'BRA 0x7f0000000008' at row 1 branches to 0x7f0000000008, which is no instruction of the page"),
])
def test_malformed_input_is_a_one_line_tool_error(text, message):
    with pytest.raises(ToolError) as error:
        hot_loops(parse_source_csv(text)[0])
    assert str(error.value) == message

