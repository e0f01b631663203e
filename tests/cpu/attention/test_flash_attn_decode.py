"""attention_decode's job takes only the dtypes it has a task for: its tasks read raw addresses as that type."""

from __future__ import annotations

import numpy as np
import pytest

from fuel.cpu.attention.flash_attn_decode import prepare
from fuel.errors import KernelError


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64, np.uint8])
def test_the_decode_job_refuses_dtypes_it_has_no_task_for(dtype: type) -> None:
    q, kv = np.ones((1, 2, 1, 16), dtype), np.ones((1, 8, 16), dtype)
    out, slopes = np.zeros((1, 2, 1, 16), dtype), np.zeros((1, 2), dtype)
    with pytest.raises(KernelError, match=rf"flash_attn: the decode path runs on f32 or f64, got {np.dtype(dtype)}"):
        prepare(q, kv, kv, out, slopes)


def test_the_decode_job_refuses_mixed_dtypes_and_strided_arrays() -> None:
    q, kv = np.ones((1, 2, 1, 16), np.float32), np.ones((1, 8, 16), np.float32)
    out, slopes = np.zeros((1, 2, 1, 16), np.float32), np.zeros((1, 2), np.float32)
    with pytest.raises(KernelError, match="C-contiguous arrays of one dtype"):
        prepare(q, kv.astype(np.float64), kv, out, slopes)
    with pytest.raises(KernelError, match="C-contiguous arrays of one dtype"):
        prepare(np.ones((1, 2, 1, 32), np.float32)[..., ::2], kv, kv, out, slopes)
