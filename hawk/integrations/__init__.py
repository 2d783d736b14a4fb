"""HAWK inside other serving stacks: each sub-package adapts HAWK's transfer to one stack's interface."""
