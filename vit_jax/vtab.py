"""VTAB-1k: the 19 tasks, their groups and splits, and the labels that 7 of them derive.

Every fact here is that of the VTAB task definitions, google-research/task_adaptation
(task_adaptation/data/<dataset>.py, the task list of scripts/run_all_tasks.sh), read at
its commit d7630d3. A task's 1k training set is train800 + val200; the final model is
tested on the task's test split, the development model on val200 (configs/finetune.py).

Seven structured tasks have no 'label' feature to predict: `example(task, features)`
computes their label from other TFDS features, as task_adaptation's preprocess functions
do, and the input pipeline applies it when config.vtab_task names such a task.

TFDS versions: the builders of tensorflow-datasets 4.9.10 are at the major versions that
task_adaptation asks for, except two, which we leave unpinned: oxford_iiit_pet 4.0.0
(asked 3.*; its release note: "Add head bounding boxes. Fix corrupt images. Update dataset
URL.") and kitti 3.3.0 (asked 3.1.0; notes: 3.2.0 "Devkit updated.", 3.3.0 labels for
`occluded`). The 4.9.10 kitti builder has no version switch, so building 3.1.0 with it
gives the same examples as 3.3.0; whether the devkit update moved images between kitti's
train/validation/test could not be checked here (no network).
"""
import collections

GROUPS = ('natural', 'specialized', 'structured')  # Figure 2 / Table 9 of the paper.

Task = collections.namedtuple('Task', 'tfds_name num_classes train800 val200 test flip group')

# task -> Task. Splits: train800 = 'train[:800]'; val200 = the first 200 of
# task_adaptation's 'val' split, which is a TFDS split or a slice at
# TRAIN_SPLIT_PERCENT of the train split (caltech101 90% of 3060, cifar 90% of 50000,
# pets 80% of 3680, svhn 90% of 73257, eurosat 60% of 27000, resisc45 60% of 31500,
# clevr 90% of 70000, dsprites 80% of 737280); test = its 'test' split (eurosat and
# resisc45: the last 20% of train; dsprites: the last 10%; smallnorb: the second half of
# test; clevr: TFDS validation). flip: False where a
# mirror image changes the label (x position, orientation, azimuth).
VTAB = {
    'caltech101': Task('caltech101', 102, 'train[:800]', 'train[2754:2954]', 'test', True,
                       'natural'),
    'cifar100': Task('cifar100', 100, 'train[:800]', 'train[45000:45200]', 'test', True, 'natural'),
    'dtd': Task('dtd', 47, 'train[:800]', 'validation[:200]', 'test', True, 'natural'),
    'oxford_flowers102': Task('oxford_flowers102', 102, 'train[:800]', 'validation[:200]', 'test',
                              True, 'natural'),
    'oxford_iiit_pet': Task('oxford_iiit_pet', 37, 'train[:800]', 'train[2944:3144]', 'test', True,
                            'natural'),
    'sun397': Task('sun397', 397, 'train[:800]', 'validation[:200]', 'test', True,
                   'natural'),  # TFDS's default config, 'tfds', as task_adaptation's.
    'svhn': Task('svhn_cropped', 10, 'train[:800]', 'train[65931:66131]', 'test', True, 'natural'),
    'patch_camelyon': Task('patch_camelyon', 2, 'train[:800]', 'validation[:200]', 'test', True,
                           'specialized'),
    'eurosat': Task('eurosat/rgb', 10, 'train[:800]', 'train[16200:16400]', 'train[21600:]', True,
                    'specialized'),
    'resisc45': Task('resisc45', 45, 'train[:800]', 'train[18900:19100]', 'train[25200:]', True,
                     'specialized'),
    'diabetic_retinopathy': Task('diabetic_retinopathy_detection/btgraham-300', 5, 'train[:800]',
                                 'validation[:200]', 'test', True, 'specialized'),
    'clevr_count': Task('clevr', 8, 'train[:800]', 'train[63000:63200]', 'validation', True,
                        'structured'),
    'clevr_distance': Task('clevr', 6, 'train[:800]', 'train[63000:63200]', 'validation', True,
                           'structured'),
    'dmlab': Task('dmlab', 6, 'train[:800]', 'validation[:200]', 'test', True, 'structured'),
    'dsprites_location': Task('dsprites', 16, 'train[:800]', 'train[589824:590024]',
                              'train[663552:]', False, 'structured'),
    'dsprites_orientation': Task('dsprites', 16, 'train[:800]', 'train[589824:590024]',
                                 'train[663552:]', False, 'structured'),
    'kitti_distance': Task('kitti', 4, 'train[:800]', 'validation[:200]', 'test', True,
                           'structured'),
    'smallnorb_azimuth': Task('smallnorb', 18, 'train[:800]', 'test[:200]', 'test[50%:]', False,
                              'structured'),
    'smallnorb_elevation': Task('smallnorb', 9, 'train[:800]', 'test[:200]', 'test[50%:]', True,
                                'structured'),
}
# The paper's VTAB-1k fine-tuning (Table 4): 2500 steps at LR 0.01; warm-up: our choice.
VTAB_STEPS, VTAB_LR, VTAB_WARMUP = 2500, 0.01, 200

# clevr.py _closest_object_preprocess_fn: the class of the nearest object's depth (third
# column of objects/pixel_coords) is the last i with THRESHOLDS[i] < depth.
CLEVR_DEPTH_THRESHOLDS = (0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0)
# clevr.py _count_preprocess_fn: objects - 3 (CLEVR scenes hold 3 to 10 objects).
CLEVR_MIN_OBJECTS = 3
# kitti.py _closest_vehicle_distance_pp: vehicles are types < 3 (Car, Van, Truck); the
# nearest one's z (objects/location[:, 2], metres) against these thresholds as above,
# with z = 1000 when there is none (the last class: "no vehicle").
KITTI_VEHICLE_TYPES = 3
KITTI_DISTANCE_THRESHOLDS = (-100.0, 8.0, 20.0, 999.0)
KITTI_NO_VEHICLE_DISTANCE = 1000.0
# dsprites.py: the TFDS class of a factor, grouped into num_classes bins of
# original_classes / num_classes values (floor of label / that factor, in float32):
# label_x_position 32 -> 16, label_orientation 40 -> 16. Its images hold 0 and 1, scaled
# to 0 and 255 there ("image needs to ... be in [0, 255)").
DSPRITES_BINNED = {
    'dsprites_location': ('label_x_position', 32),
    'dsprites_orientation': ('label_orientation', 40)
}
DSPRITES_PIXEL_SCALE = 255
# smallnorb.py: the TFDS class feature itself (label_azimuth 18 classes, label_elevation 9).
SMALLNORB_FEATURE = {'smallnorb_azimuth': 'label_azimuth', 'smallnorb_elevation': 'label_elevation'}

DERIVED_LABEL_TASKS = ('clevr_count', 'clevr_distance', *DSPRITES_BINNED, 'kitti_distance',
                       *SMALLNORB_FEATURE)


def derives_label(task, tfds_name):
  """Whether reading TFDS dataset `tfds_name` for VTAB task `task` computes the label."""
  return task in DERIVED_LABEL_TASKS and tfds_name.split(':')[0] == VTAB[task].tfds_name


def task_names(group=None):
  """The tasks of a group (all 19 for None), in the order of the table."""
  return [t for t, row in VTAB.items() if group in (None, row.group)]


def class_names(task):
  """Names of a derived task's classes, label i naming class i."""
  if task == 'clevr_count':
    return tuple(f'{n + CLEVR_MIN_OBJECTS} objects' for n in range(VTAB[task].num_classes))
  if task in ('clevr_distance', 'kitti_distance'):
    edges = (CLEVR_DEPTH_THRESHOLDS if task == 'clevr_distance' else KITTI_DISTANCE_THRESHOLDS)
    names = tuple(f'nearest in ({a:g}, {b:g}]' for a, b in zip(edges, edges[1:]))
    return names if task == 'clevr_distance' else names + ('no vehicle',)
  if task in DSPRITES_BINNED:
    feature, _ = DSPRITES_BINNED[task]
    return tuple(f'{feature} bin {i}' for i in range(VTAB[task].num_classes))
  if task in SMALLNORB_FEATURE:
    return tuple(f'{SMALLNORB_FEATURE[task]} {i}' for i in range(VTAB[task].num_classes))
  raise ValueError(f'vtab_task {task!r} has no derived label: it is one of '
                   f'{", ".join(DERIVED_LABEL_TASKS)}')


def _bin(value, thresholds):
  """The last i with thresholds[i] < value (task_adaptation's reduce_max(where(...)))."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (configs import this file)
  below = tf.cast(tf.constant(thresholds, tf.float32) < value, tf.int32)
  return tf.reduce_sum(below) - 1  # Thresholds ascend: the count below, minus one.


def example(task, features):
  """{'image': encoded bytes or uint8 [H, W, C], 'label': int32} of a derived task's TFDS
  example (images left encoded, as the pipeline reads them, except dSprites')."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (configs import this file)
  image = features['image']
  if task == 'clevr_count':
    label = tf.size(features['objects']['size']) - CLEVR_MIN_OBJECTS
  elif task == 'clevr_distance':
    label = _bin(tf.reduce_min(features['objects']['pixel_coords'][:, 2]), CLEVR_DEPTH_THRESHOLDS)
  elif task == 'kitti_distance':
    objects = features['objects']
    z = tf.boolean_mask(objects['location'][:, 2], objects['type'] < KITTI_VEHICLE_TYPES)
    nearest = tf.reduce_min(tf.concat([z, [KITTI_NO_VEHICLE_DISTANCE]], 0))
    label = _bin(nearest, KITTI_DISTANCE_THRESHOLDS)
  elif task in DSPRITES_BINNED:
    feature, original_classes = DSPRITES_BINNED[task]
    factor = original_classes / VTAB[task].num_classes
    label = tf.math.floordiv(tf.cast(features[feature], tf.float32), factor)
    if image.dtype == tf.string:
      image = tf.io.decode_png(image, channels=1)
    image = image * DSPRITES_PIXEL_SCALE
  elif task in SMALLNORB_FEATURE:
    label = features[SMALLNORB_FEATURE[task]]
  else:
    raise ValueError(f'vtab_task {task!r} has no derived label: it is one of '
                     f'{", ".join(DERIVED_LABEL_TASKS)}')
  return {'image': image, 'label': tf.cast(label, tf.int32)}
