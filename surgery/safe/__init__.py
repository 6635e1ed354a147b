"""The trust layer: what a config from someone else may ask for, checked before any work.

``hydra_tree`` (the ``hydra.*`` allowlist, callbacks, sweep sizes), ``logging_tree`` (job logging
handlers and formats), ``interpolations`` (resolvers, loops and sizes), ``yaml_guard`` (alias bombs,
tags), ``config_paths`` (paths a config file names stay in the start directory) and ``costs`` (what a
run will cost, from the config's arithmetic, against ``limits``). Files themselves are opened only by
:mod:`surgery.files`, the gate. Nothing here imports the application.
"""
