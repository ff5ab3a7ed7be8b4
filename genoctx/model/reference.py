"""Slow, obviously-correct reference implementations used by the tests.

Nothing here is used on a training path. Each function says which fast path it checks.
"""

from __future__ import annotations

import torch  # noqa: F401

# ---- KDA references (owned by the KDA work; edit only inside this section) ----

# ---- end KDA references ----


# ---- DSA references (owned by the DSA work; edit only inside this section) ----

# ---- end DSA references ----
