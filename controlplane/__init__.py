"""kvprefetch control plane: config, trace loaders, scheduling core, simulator, CLI."""

__version__ = "0.1.0"
