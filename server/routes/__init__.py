"""The HTTP surface, one router per resource."""
