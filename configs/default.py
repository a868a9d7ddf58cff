"""Defaults for every field; the other configs import this and override a few fields.

python -m recsys_jax.main --config=configs/default.py --config.num_steps=100
"""

import ml_collections

from recsys_jax.data.synthetic import DEFAULT_VOCAB


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds parameter init, PS row init and (via data.seed) the data.
  # Optimizer steps in the whole run (a resumed run continues to this); -1: until stopped (SIGTERM: a
  # final checkpoint at the step reached, exit 0) or until a stream ends (data.stream_idle_exit_s).
  c.num_steps = 1000
  c.batch_size = 4096  # Global examples per step (split over all devices).
  c.staleness = 0  # k: lookups of step t wait for pushes of steps <= t-k-1; 0 = synchronous.
  # Dense gradients applied this many steps late (0: the dense part is synchronous, Persia's
  # hybrid). With staleness k as well, Persia's fully asynchronous baseline.
  c.dense_staleness = 0
  c.prefetch_depth = 2  # Steps placed on the device ahead of the training loop.
  # A step's inputs go to the device packed in two buffers (recsys_jax/training/packing.py); True:
  # each is first staged in pinned (page-locked) host memory, where the devices have it (GPUs;
  # ignored on a CPU), so the copy to the device is a DMA from it.
  c.place_pinned_host = False
  # Host worker threads that parse and dedup batches ahead of the loop (-1: one per core; 0: none,
  # all on the prefetcher thread). Results do not depend on it (recsys_jax/training/feed.py).
  c.host_workers = -1
  # Hot rows on the device (recsys_jax/training/hot_rows.py): the most frequent ids of every table
  # live on the accelerator with their optimizer state and train synchronously in the step; the
  # rest go through the PS with staleness k. Device bytes for them (rows and slots; split across
  # row widths by lookups per record, across tables by measured frequency); 0 = none. Bounded tables
  # (embeddings.capacity, expire_after, admit_*) are never hot: their bounds see every use.
  c.hot_rows_bytes = 4 << 20  # 32k rows of width 16 with Adagrad: raise it on an accelerator.
  # Steps counted before the first choice. Short: the first steps, with the largest updates, are
  # the ones staleness hurts most (20 steps here cost 0.4% AUC at k = 4 on the synthetic data).
  c.hot_warmup_steps = 5
  c.hot_every = 200  # Steps between re-choices (0: choose once, after the warm-up).
  c.hot_min_count = 2  # An id must have been seen in this many steps to be chosen.
  # Count the ids of one step in this many (the steps whose number it divides): at batches of 65k
  # a step has ~200k distinct ids, and counting them all costs ~15 ms of a core; one step in 4
  # ranks the frequent ids the same way at a quarter of it. The set is still the same for the
  # same data (deterministic). 1: every step (the main job's).
  c.hot_count_every = 1
  c.hot_rows_per_table = ml_collections.ConfigDict()  # table -> rows it gets first (0: never hot).
  c.log_every = 50  # Steps between train-metric records (metrics.jsonl, TensorBoard).
  c.checkpoint_every = 0  # Steps between checkpoints (0: only at the end of the run).
  # Write a checkpoint at the end of the run. False: none there (a benchmark's run, whose PS
  # snapshot would only cost time and disk; checkpoint_every still saves during the run).
  c.final_checkpoint = True
  c.max_checkpoints = 2  # Checkpoints kept in <workdir>/checkpoints.
  c.checkpoint_full_every = 4  # Every 4th PS snapshot is full, the others incremental (1: all full).
  # Rows for serving between checkpoints (recsys_jax/online/publish.py), for a model server that
  # applies them without reloading (python -m recsys_jax.serve; docs/serving.md).
  c.publish_every_s = 0.0  # Seconds between deltas of the rows touched since the last one (0: off).
  c.publish_dense_every_s = 30.0  # Seconds between publishes of the dense parameters (with a delta).
  c.publish_dir = ""  # Where they go: '' = <workdir>/publish; a relative path is under the workdir.
  c.eval_every = 0  # Steps between evaluations during training (0: only at the end).
  c.eval_samples = 131072  # Eval examples (synthetic: the split size; files: at most this many; 0: all).
  c.eval_batch_size = 16384  # Examples per eval step.
  c.progress_bar = True  # tqdm bar with samples/s and loss on stderr.
  # The jitted device step: 'model' trains the model; 'none' returns zero row gradients and leaves
  # the dense state and hot rows as they are, so a run measures the host pipeline alone (reading,
  # dedup, PS lookups and pushes, copies to and from the device: experiments/bench_feed.py). 'score'
  # scores each batch and updates nothing (a frozen model scored on the stream: progressive metrics only).
  c.device_step = "model"

  # Input data (recsys_jax/data/readers.py): 'synthetic' (Criteo-like schema, known oracle AUC),
  # 'criteo' (Kaggle/Terabyte TSV), 'avazu' (CSV), 'csv' or 'parquet' (columns declared below),
  # 'movielens' (a directory with ratings.csv and movies.csv).
  c.data = ml_collections.ConfigDict()
  c.data.name = "synthetic"  # Which reader: one of the names above.
  c.data.seed = 0  # Seed of the synthetic teacher and stream; of the shuffled order of files.
  # Files (criteo, avazu, csv, parquet): glob patterns; .gz is read as gzip.
  c.data.train_files = ()
  c.data.eval_files = ()  # Evaluation reads the first eval_samples records of these, in order.
  c.data.on_bad_record = "error"  # 'error': stop, naming file, line and field; 'skip': drop and count.
  c.data.shuffle = True  # Permute files each epoch and records within a window.
  c.data.chunk_records = 8192  # Records per chunk (the unit split between processes).
  c.data.shuffle_window = 16  # Chunks per shuffle window (memory: one window of records).
  # Online training (docs/data.md, "Online training: streams"): a directory that files of the format
  # above arrive in; training reads each file once, in arrival order, as they come ('': the
  # train_files, in epochs). A file counts once it is renamed into place: names that start with '.'
  # or end in '.tmp' or '.inprogress' are a writer's and are ignored. One trainer process.
  c.data.stream_dir = ""
  c.data.stream_poll_s = 1.0  # Seconds between listings of stream_dir while no complete file waits.
  # End the run (final checkpoint, exit 0) once stream_dir gave no new file for this long (0: wait forever).
  c.data.stream_idle_exit_s = 0.0
  # Preprocessed cache of criteo/avazu/csv/parquet files (recsys_jax/data/cache.py): the first pass
  # writes each parsed chunk there, later epochs and runs read it. '' = <workdir>/data_cache;
  # a relative path is under the workdir (an absolute one can be shared by runs); 'none' = off.
  c.data.cache_dir = ""
  # Generic csv/parquet: which columns are what.
  c.data.label = "label"  # The label column.
  c.data.label_threshold = None  # Label = value >= threshold (None: the column holds 0/1).
  c.data.dense = ()  # Numeric columns.
  c.data.dense_transform = "log1p"  # 'log1p' (log(1 + max(x, 0))) or 'none'.
  c.data.categorical = ()  # One id per record, hashed per column.
  c.data.multi_hot = ()  # (column, separator, max_len): a bag of ids.
  c.data.sequence = ()  # (column, separator, max_len): ordered ids, the last max_len kept.
  c.data.delimiter = ","  # CSV field separator.
  # MovieLens: label rating >= 4; user, movie, genres (multi-hot), history (sequence).
  # The MovieLens directory ('': movielens-latest-small in $RECSYS_JAX_DATA, ./data, <checkout>/data or
  # <checkout>/../shared/data; get it with `python -m recsys_jax.data.get movielens`).
  c.data.path = ""
  c.data.max_history = 50  # The user's most recent earlier-rated movies kept as the sequence.
  c.data.max_genres = 8  # Genre ids per movie.
  c.data.eval_fraction = 0.2  # The latest ratings in time go to evaluation:
  c.data.split = "user"  # 'user': the latest of each user's ratings; 'time': the latest of all.
  # Synthetic data:
  c.data.num_dense = 13  # Dense (count) features.
  c.data.vocab_sizes = DEFAULT_VOCAB  # Distinct ids per categorical field (26 fields).
  c.data.zipf_alpha = 1.2  # Exponent of the Zipf law of id frequencies.
  c.data.multi_hot = ()  # Max bag length per field (empty: every field one-hot).
  # The hidden teacher that draws the labels (see recsys_jax/data/synthetic.py):
  c.data.bias = -1.0  # Logit offset (sets the click rate).
  c.data.dense_scale = 0.6  # Weight of the dense-feature term.
  c.data.id_scale = 0.5  # Std of each id's own additive effect on the logit.
  c.data.pair_scale = 0.3  # Weight of the field-pair dot-product interactions.
  c.data.num_pairs = 12  # Field pairs that interact.
  c.data.teacher_dim = 4  # Width of the teacher's interaction vectors.
  # A drifting teacher (online learning): its id effects and interaction vectors turn, record by
  # record, a quarter turn (to independent ones) every drift_records training records; 0 = fixed.
  c.data.drift_records = 0
  # The eval split is drawn as the training records from this index on would be (with drift, the
  # teacher as it stands there): num_steps * batch_size evaluates on what follows the training.
  c.data.eval_at_record = 0

  # Embedding tables on the parameter server: one table per categorical feature.
  c.embeddings = ml_collections.ConfigDict()
  c.embeddings.dim = 16  # Row width of every table.
  c.embeddings.optimizer = "adagrad"  # Row optimizer (recsys_jax/async_ps/optim/optimizers.py).
  c.embeddings.learning_rate = 0.15  # Row optimizer step size.
  c.embeddings.initial_accumulator_value = 0.0  # Adagrad accumulator of a new row.
  c.embeddings.initializer = "uniform"  # New rows: 'uniform', 'normal' or 'zeros'.
  c.embeddings.init_scale = 0.05  # Half-width (uniform) or std (normal) of new rows.
  c.embeddings.combiner = "sum"  # Pooling of multi-hot bags: 'sum', 'mean' or 'sqrtn'.
  # Per-feature overrides, feature name -> any of {table, dim, combiner, kind ('pooled' or
  # 'sequence')}; e.g. two features reading one table: {'history': {'table': 'movie'}}.
  # Unlisted features read their own table (or the one the reader names) at embeddings.dim.
  c.embeddings.features = ml_collections.ConfigDict()
  c.embeddings.clip = 0.0  # Clip row weights to [-clip, clip] after each update (0: no clipping).
  c.embeddings.storage_dtype = "float32"  # Row storage: 'float32', 'bfloat16', 'float16'.
  c.embeddings.capacity = 0  # Rows per table in RAM (0: unbounded); beyond it rows are evicted.
  c.embeddings.eviction = "lru"  # Which rows go first: 'lru' or 'lfu'.
  c.embeddings.expire_after = 0  # Drop rows unseen for this many steps (0: never).
  c.embeddings.admit_after = 1  # Create a row once its id was seen this many times (1: at once).
  c.embeddings.admit_probability = 1.0  # Or create it with this probability per lookup.

  # The parameter server.
  c.ps = ml_collections.ConfigDict()
  c.ps.num_shards = 1  # Shards per table (worked in parallel); ids routed by hash(table, id).
  # local: threads that work the tables (and shards) of one lookup or push at once, the caller's
  # included; -1: the cores this process may run on. Results are bit-identical for any count.
  c.ps.threads = -1
  # Disk tier for bounded tables: '' (none; evicted rows are dropped), 'memory', a directory
  # (relative to the workdir), or a JSON tensorstore kvstore spec (file, gcs, s3, ...).
  c.ps.tier = ""
  # With a tier: the trainer hands a step's ids to the PS this many steps before its lookup, and
  # a reader thread brings the step's tier rows into the RAM cache and pins them (and the step's
  # rows already there) until that step, so the lookup finds them all in RAM (0: off). Every row
  # read is the same bit for bit; only where rows lie changes. Off by default, by measurement: on
  # 2 cores the main job's host work keeps both busy, so the reads cost the same CPU on another
  # thread (docs/parameter-server.md); turn it on where the host has cores to spare or the tier's
  # reads wait (a cold or network disk). Pinned rows count in the RAM cache, at most
  # ps.read_ahead_rows per table shard (0: half its capacity).
  c.ps.read_ahead = 0
  c.ps.read_ahead_rows = 0  # Per table shard, the most rows read-ahead may pin (0: half its capacity).
  # 'local': the PS lives in this process. 'remote': PS shard servers
  # (python -m recsys_jax.async_ps.server), reached over gRPC; required with several trainers.
  c.ps.kind = "local"
  c.ps.addresses = ""  # remote: comma-separated host:port of the servers, in shard order.
  c.ps.token_file = ""  # remote: a file holding the shared token the servers expect ('' = none).
  c.ps.tls_ca = ""  # remote: CA certificate (PEM) to verify the servers' TLS ('' = plaintext).
  c.ps.wire_dtype = "float32"  # remote: rows and gradients on the wire: float32, bfloat16, float16.
  # remote: deadline of every call, its retries included; a dead or hung server stops the run within it.
  c.ps.timeout_s = 30.0
  # remote: deadline of a snapshot or restore call, which moves a whole shard to or from disk
  # (0: 10 x timeout_s). A server that hangs during one is detected within it.
  c.ps.snapshot_timeout_s = 0.0
  # remote: the largest request or answer of one call to a server, MiB; larger lookups and pushes
  # go in chunks (0: each server's --max_message_mb, which also caps this).
  c.ps.max_request_mb = 0.0

  # The dense model: model.name names the module recsys_jax/models/<name>.py, whose MODEL is the class
  # (docs/models.md); model.kwargs are its constructor arguments.
  c.model = ml_collections.ConfigDict()
  c.model.name = "dlrm"  # A module of recsys_jax/models/ that declares MODEL.
  c.model.kwargs = ml_collections.ConfigDict()
  c.model.kwargs.bottom = (64, 32, 16)  # Bottom MLP widths; the last equals embeddings.dim.
  c.model.kwargs.top = (128, 64)  # Top MLP hidden widths.

  # Dense optimizer (optax), applied synchronously on every replica.
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adam"  # 'adam', 'adagrad' or 'sgd'.
  c.optimizer.learning_rate = 2e-3  # Step size of the dense optimizer.
  # Where the dense optimizer state lives: 'device', or 'pinned_host' (Cerebras-style: kept in
  # host memory and streamed to the device for each update; saves device memory on a GPU).
  c.optimizer.state_memory = "device"

  # Device mesh: sizes of the replica and fsdp axes (-1 fills the rest of the devices).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.replica = -1  # Replica groups (data parallel across groups).
  c.mesh.fsdp = 1  # Devices per group that shard the dense parameters (FSDP inside a group).
  # Logical axis names (declared by the models) -> mesh axes: dense parameters and their
  # optimizer state are sharded over fsdp inside a group and replicated across groups.
  c.mesh.rules = (("mlp", "fsdp"), ("embed", None))
  # Micro-batches per optimizer step (gradient accumulation, MiCS 2-hop sync): gradients are
  # reduce-scattered inside the group every micro-step and all-reduced across groups once per
  # step; row gradients are summed over the micro-batches and pushed once. batch_size must be a
  # multiple of devices x micro_steps.
  c.micro_steps = 1

  # Progressive validation (recsys_jax/online/progressive.py): each training batch is scored
  # before it is trained on (the step's own forward pass), and every log_every steps the AUC,
  # logloss and calibration of the last `window` events go to metrics.jsonl and TensorBoard
  # (kind 'progressive').
  c.progressive = ml_collections.ConfigDict()
  c.progressive.window = 1_000_000  # Events in the sliding window (0 = off).
  return c
