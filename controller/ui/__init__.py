"""The browser UI's static files (``static/``: index.html, ES modules, CSS), served under ``/ui`` by
:mod:`controller.api.routes_ui`. No build step and no third-party code: the plots are inline SVG drawn by
``static/plot.js``; every value from the API is put into the page as text (``textContent``), never as markup.
"""
