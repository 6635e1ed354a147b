"""The safe expression language: ``check`` parses and checks once at plan time, ``runtime`` runs fast in hooks."""
