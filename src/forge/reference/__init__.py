"""The generated pages of the docs' Reference section: config fields (forge.config.help), the support matrix
(forge.config.support), the model presets (presets.py) and the commands' help (commands.py).

    python -m forge.reference            # rewrite every generated page
    python -m forge.reference --check    # exit 1 naming each stale page (tests/docs/test_reference.py)
"""
