"""The engine a Python user imports: select modules, compile a plan, apply it all-or-nothing, remove it exactly."""
