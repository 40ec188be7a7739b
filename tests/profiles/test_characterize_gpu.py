"""On a CUDA GPU: `mpfa profile characterize` end to end at 4K tokens — every ladder step runs, times are
positive, and the full kernel is not faster than the most ablated one."""
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_characterize_4k(tmp_path):
    from mpfa.profiles.characterize import run_characterize

    result = run_characterize(4096, 1, (32, 8), 128, tmp_path, context=("fa4-bf16",))
    medians = [row.timing.median_ms if row.timing else None for row in result.ladder]
    assert all(row.error is None for row in result.ladder), [row.error for row in result.ladder]
    assert result.direct is not None and result.direct.error is None and result.compensation() > 0
    assert all(ms > 0 for ms in medians)
    assert medians[0] >= medians[-1], medians  # full >= QK MMA + loads only
    assert medians[0] >= min(medians[1:]), medians
    shares = result.shares()
    assert shares is not None and sum(s.fraction for s in shares) == pytest.approx(1.0)
    data = json.loads(open(result.json_path).read())
    assert data["ladder"][0]["sm_us_per_block"] > 0
