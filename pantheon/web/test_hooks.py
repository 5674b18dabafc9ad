"""`POST /admin/test/faults`: fault injection at runtime, only with PANTHEON_TEST_HOOKS=1."""

from __future__ import annotations

from quart import Blueprint

from pantheon.config import test_hooks_enabled
from pantheon.faults import FAULTS
from pantheon.web.errors import ApiError, invalid, json_body

bp = Blueprint("test_hooks", __name__)


@bp.route("/admin/test/faults", methods=["POST"])
async def set_faults():
    if not test_hooks_enabled():
        raise ApiError(404, "not_found", "unknown route")
    body = await json_body()
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    try:
        for key, value in body.items():
            FAULTS.set(key, value)
    except (ValueError, TypeError) as e:
        raise invalid(str(e)) from None
    return FAULTS.snapshot()
