"""Running a recipe: planning (pure), process control, the runner, publishing, and the run record."""
