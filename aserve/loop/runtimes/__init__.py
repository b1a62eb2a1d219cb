"""Model runtimes: one served model version each, on the event loop."""
