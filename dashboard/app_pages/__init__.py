"""One thin file per dashboard page (query -> figure -> render); `empty_state` is shown when no run exists."""
