"""credproxy's store: principals, credentials and grants, sealed at rest."""
