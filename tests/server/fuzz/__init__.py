"""Generated requests against the real server: schemathesis from its schema, and field
combinations over long prompts."""
