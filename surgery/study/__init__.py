"""Studies (SPEC §13): grids of interventions scored per example. Built up in steps: the grid and the metrics first."""
