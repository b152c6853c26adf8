"""The backend-agnostic core: graph IR, builder, plugins, scheduler, executor, config, compare."""
