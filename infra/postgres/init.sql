-- The three databases of a team install, in one Postgres server (infra/compose.yaml). The postgres image
-- runs this once, on the first start with an empty data volume, as POSTGRES_USER, who owns them.
CREATE DATABASE prefect;  -- the Prefect server (PREFECT_API_DATABASE_CONNECTION_URL)
CREATE DATABASE mlflow;   -- the MLflow tracking server and model registry (MLFLOW_BACKEND_STORE_URI)
CREATE DATABASE optuna;   -- the sweeps' Optuna storage, shared by every worker (MLSTM_SWEEP_STORAGE_URI)
