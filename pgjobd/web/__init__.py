"""`pgjobd web`: the console (pages and /api/) on Starlette, Jinja2 and htmx.

Needs the `web` extra (``pip install 'pgjobd[web]'``). `app.create_app` builds the ASGI
application; `serve.run` serves it with uvicorn. docs/web.md describes both.
"""
