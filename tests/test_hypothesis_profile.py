"""The suite runs hypothesis's derandomized `ci` profile unless HYPOTHESIS_PROFILE names another."""

from __future__ import annotations

import os

from hypothesis import settings


def test_the_profile_is_derandomized_by_default() -> None:
    wanted = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    assert settings.default.derandomize == (wanted == "ci")
    assert settings.get_profile("ci").derandomize and not settings.get_profile("explore").derandomize
