"""Fields shared by every config: one comment line each; override any with --config.x=..."""
import ml_collections


def get_config():
  """The base config: every field the loop reads, with neutral defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # One seed for init, data order, augmentation and dropout.

  # Model.
  c.model_name = 'ViT-B_16'  # A name from vit_jax.models.VARIANTS.
  # Variant overrides, e.g. dropout_rate, representation_size: --config.model.X takes any
  # field of the variant (vit_jax/models/variants.py), listed here or not.
  c.model = ml_collections.ConfigDict()
  c.dtype = 'float32'  # Compute dtype ('float32' or 'bfloat16'); parameters stay float32.
  c.remat = ml_collections.FieldReference('', field_type=object)  # Remat policy (models/remat.py).
  c.num_classes = -1  # Head size; -1 takes it from the dataset.
  c.head_bias_init = 0.0  # Head bias init (-10 for sigmoid pre-training on ImageNet-21k/JFT).

  # Data.
  c.dataset = 'fashion_mnist_local'  # TFDS name, 'folder:<dir>' or 'fashion_mnist_local'.
  c.data_dir = ''  # TFDS data_dir (may be gs://) or the folder of the local IDX files.
  c.train_split = 'train'  # Split used for training.
  c.eval_split = 'test'  # Split evaluated completely at every evaluation.
  c.eval_real = False  # Also ImageNet ReaL top-1 (imagenet2012_real in data_dir) at each evaluation.
  c.num_train_examples = -1  # Training-set size, for epochs -> steps; -1 asks the dataset.
  c.label_key = 'label'  # TFDS label feature; a set of labels (Sequence(ClassLabel)): multi-hot.
  c.vtab_task = ''  # VTAB-1k task of a finetune.py row ('clevr_count', ...); '' for others.
  c.image_size = 224  # Training and evaluation resolution.
  c.pp = ml_collections.ConfigDict()
  c.pp.train_crop = 'inception'  # 'inception' (random area crop) or 'resize' (whole image).
  c.pp.inception_min_area = 0.05  # Smallest crop area fraction of the Inception crop.
  c.pp.flip = True  # Random horizontal flip at training.
  c.pp.eval_crop = 'resize'  # 'resize' (whole image) or 'central' (resize then central crop).
  c.pp.central_crop_fraction = 0.875  # Fraction of the side kept by the central crop.
  c.shuffle_buffer = 50_000  # Examples in the training shuffle buffer (per host).
  c.prefetch = 2  # Batches prefetched to the devices.

  # Optimisation.
  c.batch_size = 4096  # Global training batch, over all hosts and devices.
  c.eval_batch_size = 512  # Global evaluation batch (the last one is padded and masked).
  c.accum_steps = 1  # Gradient accumulation: micro-batches per step; 0 picks the fewest that fit.
  c.device_memory_mb = 0.0  # Memory per device for the fit check; 0 asks the device (CPU: host's free).
  c.optimizer = 'adam'  # 'adam' (Table 3) or 'sgd' (Table 4, momentum).
  c.adam_b1 = 0.9  # Adam beta1.
  c.adam_b2 = 0.999  # Adam beta2.
  c.momentum = 0.9  # SGD momentum.
  c.base_lr = 1e-3  # Peak learning rate, reached at the end of the warm-up.
  c.lr_decay = 'linear'  # 'linear' or 'cosine' decay after the warm-up.
  # Where linear decay ends, at total_steps: the last update (total_steps - 1) is one decay
  # step above it.
  c.end_lr = 0.0
  c.warmup_steps = 10_000  # Linear warm-up from 0 to base_lr.
  c.total_steps = -1  # Training steps; -1 derives them from num_epochs.
  c.num_epochs = -1.0  # Epochs over the training set when total_steps is -1.
  c.weight_decay = 0.0  # Decoupled decay on kernels, scaled by the learning rate (as AdamW).
  c.grad_clip_norm = 1.0  # Global-norm gradient clipping; 0 turns it off.
  # Polyak averaging of the parameters (vit_jax/polyak.py; Table 2: 0.9999): the average is
  # what evaluation, few-shot and final.npz use. 0 turns it off.
  c.polyak_decay = 0.0
  c.loss = 'softmax_xent'  # 'softmax_xent' or 'sigmoid_xent' (multi-label pre-training).
  # Targets (1 - s) * y + s / classes. Sec. 4.3 tunes it, with weight decay and dropout, for
  # the smaller pre-training datasets; the paper gives no value. 0 turns it off.
  c.label_smoothing = 0.0
  c.objective = 'classification'  # Or 'masked_patches': self-supervised pre-training (Sec. 4.6).

  # Masked patch prediction (objective 'masked_patches'; vit_jax/masked_patches.py).
  c.masked_patches = ml_collections.ConfigDict()
  c.masked_patches.target = 'mean_color'  # 'mean_color' (3-bit, paper), 'downsized' or 'pixels' (L2).
  c.masked_patches.corrupt_rate = 0.5  # Fraction of each image's patches corrupted (paper: 50%).
  c.masked_patches.mask_prob = 0.8  # Of the corrupted: replaced by the learned [mask] embedding.
  c.masked_patches.random_prob = 0.1  # Of the corrupted: replaced by another patch; the rest kept.
  c.masked_patches.bits = 3  # Bits per colour channel of the targets (3: 512 colours).
  c.masked_patches.downsize = 4  # Cells per side of the 'downsized' target (4x4: 16 predictions).

  # Fine-tuning from a published checkpoint.
  c.pretrained_path = ''  # A published-format .npz; empty trains from scratch.
  c.pretrained_keep_prelogits = False  # Keep the pre-logits layer of the checkpoint.
  c.lr_grid = ()  # Learning rates a sweep expands (Table 4); base_lr is the default.

  # Few-shot linear evaluation of the pre-logits during training (paper Sec. 4.1, Fig. 4, Table 8):
  # accuracy per dataset and, for each k, the mean over the datasets.
  c.fewshot_every_steps = 0  # Period; 0 turns it off.
  # (dataset, k-shot pool split, held-out split) each; () means (dataset, train_split, eval_split).
  c.fewshot_datasets = ()
  c.fewshot_data_dir = ''  # Their data_dir; '' means `data_dir`.
  c.fewshot_shots = (1, 5, 10, 25)  # k values.
  c.fewshot_seeds = (0, 1, 2)  # One k-shot draw per seed; the mean is reported.
  c.fewshot_l2_reg = 1024.0  # Ridge regulariser of the closed-form least squares.
  # Features centred and scaled per dimension by the k-shot set's mean and deviation before
  # the fit. On, as big_vision's few-shot evaluator always does: l2_reg then means the same
  # for any model, whatever the scale of its features (LayerNorm, tanh or pooled ReLU).
  c.fewshot_standardise = True
  c.fewshot_batch_size = 0  # Batch for feature extraction; 0 means eval_batch_size.
  c.fewshot_cache_mb = 2048  # Held-out images kept in memory up to this size.

  # Devices.
  c.mesh_data = -1  # Devices on the data axis; -1 uses all.
  # On the CPU backend: XLA devices the host's cores are split into (data parallel over
  # them, each device's program on its own thread). TPU and GPU runs ignore it.
  c.cpu_devices = 1
  c.fsdp = False  # Shard parameters and optimizer state over the data axis.

  # Loop.
  c.log_every_steps = 50  # Progress line and training metrics; 0 only at the end.
  # MFU's denominator, peak FLOP/s per device (vit_jax/device_peaks.py): 0 takes the TPU/GPU
  # table, or on CPU a matmul timed at start-up.
  c.peak_flops_per_device = 0.0
  c.profile_first_step = 0  # First step of a jax.profiler trace (<workdir>/profile).
  c.profile_steps = 0  # Steps traced from profile_first_step; 0: no trace.
  c.eval_every_steps = 1000  # Evaluation on eval_split; 0 only at the end.
  c.checkpoint_every_steps = 1000  # Orbax checkpoint period; 0 only at the end (and on a signal).
  c.keep_checkpoints = 3  # Checkpoints kept on disk (1 or more; -1 keeps all).
  c.on_nonfinite = 'stop'  # Non-finite loss/gradient/update: 'stop' (exit 1, never saved) or 'skip'.
  c.resume_changes = ''  # Fields allowed to differ from the workdir's run: 'base_lr,model', '*'.
  return c
