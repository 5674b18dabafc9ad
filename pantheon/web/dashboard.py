"""`GET /admin/ui`: one static page (HTML + a small script, served from the package: no build step,
no CDN) that polls /admin/models, /admin/dies and /metrics and draws what an operator reads at a
glance — per model: served vs configured concurrency and window, graphs and attention residency
as bars (faults in red: `failed`, `host > 0`), sessions, throughput and time to first token over
the last minutes; per die: memory used against budget.

The page itself holds no data, so it loads without the admin token; with PANTHEON_ADMIN_TOKEN set,
open it as /admin/ui#token=<token>: the script sends the token on its own requests (a URL fragment
never reaches the server or its logs)."""

from __future__ import annotations

from importlib import resources

from quart import Blueprint, Response

bp = Blueprint("dashboard", __name__)
PATH = "/admin/ui"


@bp.route(PATH, methods=["GET"])
async def dashboard():
    html = resources.files("pantheon.web").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    return Response(html, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})
