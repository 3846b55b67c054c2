"""The inverse-square-root learning-rate schedule with linear warm-up."""
import pytest

from parallel.engine_config import inverse_sqrt


def test_linear_warmup_then_inverse_sqrt():
    f = inverse_sqrt(4)
    # LambdaLR passes the zero-based count of finished steps; step n uses f(n - 1).
    assert [f(n - 1) for n in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert [f(n - 1) for n in (5, 16, 100)] == pytest.approx([(4 / 5) ** 0.5, 0.5, 0.2])


def test_no_warmup_starts_at_full_lr():
    f = inverse_sqrt(0)
    assert [f(n - 1) for n in (1, 4, 100)] == pytest.approx([1.0, 0.5, 0.1])
