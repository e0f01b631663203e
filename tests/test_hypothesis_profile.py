"""The suite runs hypothesis's `ci` profile (derandomized) under CI and `dev` elsewhere."""

from __future__ import annotations

import os

from hypothesis import settings


def test_the_profile_follows_the_environment() -> None:
    wanted = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
    assert settings.default.derandomize == (wanted == "ci")
    assert settings.get_profile("ci").derandomize and not settings.get_profile("dev").derandomize
