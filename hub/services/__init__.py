"""Hub services: processes the hub starts beside itself, each with its own role."""
