"""The step model: what a step costs on a device (`step_time`), the work a layout does on its
busiest rank (`work`), devices as data (`device`)."""
