"""Settings: the one table of settings and where they come from (flags, environment, profiles, the config file,
the model), the config file written in place, saved prompt templates."""
