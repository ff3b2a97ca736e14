"""The live router: an OpenAI-compatible aiohttp reverse proxy driving ``core.fleet.Fleet``.

Public API: ``make_app(config, *, clock, session, fleet)`` builds the app (tests and
``kvroute serve`` alike); ``load_config`` turns YAML + flags into a ``RouterConfig``.
"""

from kvroute.router.app import make_app
from kvroute.router.config import BackendConfig, RouterConfig, load_config

__all__ = ["BackendConfig", "RouterConfig", "load_config", "make_app"]
