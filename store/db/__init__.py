"""The database behind one URL: engine, schema, change log, the sqlite3 quick path."""
