"""The load-test client: streams requests at a server and reports what it measured (`python -m loadtest`).
Its terminal progress bar and plots need the `loadtest` extra (rich, matplotlib)."""
