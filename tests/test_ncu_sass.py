"""CPU tests of benchmarks/ncu_sass.py, the summary of an Nsight Compute SASS source page."""
import pytest

from helpers import load_benchmark

ncu_sass = load_benchmark("ncu_sass")

HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
       "stall_long_sb", "stall_long_sb (Not Issued)"]


def _page(tmp_path):
    """Two kernels in the page's layout: a 3-line epilogue run 16 times and a 2-line K loop run 8 times as
    often (one tile of 16 warps, BT/BK = 8), then a second kernel of one line."""
    rows = [("0x10", "  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24", 30, 128, 30, 0, 0),
            ("0x20", "  @P0 BAR.SYNC.DEFER_BLOCKING 0x0", 10, 128, 10, 0, 0),
            ("0x30", "  LDG.E.128 R4, desc[UR4][R2.64]", 5, 16, 0, 5, 5),
            ("0x40", "  IMAD.U32 R40, R80, 0x10000, RZ", 50, 16, 0, 50, 50),
            ("0x50", "  STG.E.128 desc[UR4][R2.64], R4", 5, 16, 0, 5, 5)]
    csv = ['"Kernel Name","forge_fused_kernel",', ",".join(f'"{h}"' for h in HDR)]
    csv += [",".join(f'"{v}"' for v in r) for r in rows]
    csv += ['"Kernel Name","other",', ",".join(f'"{h}"' for h in HDR), '"0x10","  EXIT","1","4","0","0","0"']
    p = tmp_path / "source.csv"
    p.write_text("\n".join(csv) + "\n")
    return p


def test_blocks_split_the_page_per_kernel(tmp_path):
    pages = ncu_sass.blocks(_page(tmp_path))
    assert [len(rows) for _, rows in pages] == [5, 1]
    assert pages[0][0][:2] == ["Address", "Source"]


def test_regions_group_lines_by_how_often_they_ran(tmp_path):
    hdr, rows = ncu_sass.blocks(_page(tmp_path))[0]
    regs = ncu_sass.regions(rows, hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Instructions Executed"))
    # K loop: 2 lines x 128 = 256 of 304 instructions, 40 of 100 samples; epilogue: 3 x 16 = 48, 60 samples
    (n0, lines0, i0, s0, top0), (n1, lines1, i1, s1, top1) = regs
    assert (n0, lines0, n1, lines1) == (128, 2, 16, 3)
    assert i0 == pytest.approx(256 / 304) and s0 == pytest.approx(0.40)
    assert i1 == pytest.approx(48 / 304) and s1 == pytest.approx(0.60)
    assert dict(top0) == {"HGMMA": 1, "BAR": 1} and dict(top1) == {"LDG": 1, "IMAD": 1, "STG": 1}


def test_summary_prints_stalls_and_regions(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["ncu_sass.py", str(_page(tmp_path)), "--top", "2"])
    ncu_sass.main()
    out = capsys.readouterr().out
    assert "=== kernel 0: 5 SASS lines" in out and "=== kernel 1: 1 SASS lines" in out
    assert "stall reasons: long_sb 60.0%, barrier 40.0%" in out
    assert "run       128 times:     2 lines,  84.2% of instructions,  40.0% of samples" in out
