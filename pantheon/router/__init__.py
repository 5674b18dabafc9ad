"""The router: a registry of serve instances and session-aware dispatch (pantheon/router/app.py)."""

from pantheon.router.app import app, create_app

__all__ = ["app", "create_app"]
