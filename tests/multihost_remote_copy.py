"""One process of two, each with one CPU device, running a Pallas TPU kernel in interpret mode
over both devices (tests/test_multihost.py starts the two): what a sharded megakernel's remote
DMAs do when the ranks are in different processes off a TPU.

The kernel is a collective's first move as our kernels make it (notebook 08, kernels/sharded):
signal the peer's barrier semaphore, wait for its signal, send x into the peer's output by a
remote DMA. In interpret mode every device's memory and semaphores live in the Python process
that runs the kernel (jax's `pallas.mosaic.interpret.shared_memory`), so the signal to a device
of the other process lands in this process's copy of its semaphore and the wait never returns:
no error, a wait forever in `semaphore_wait`. faulthandler prints this process's stack every
few seconds so the test sees where it waits; "ran" is printed if it ever finishes.

    python tests/multihost_remote_copy.py PROCESS_ID PORT
"""

import faulthandler
import sys

DUMP_EVERY_S = 3  # how often the stack is printed to stderr while the kernel runs


def main(process_id: int, port: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))  # one device in each process

    def kernel(x_ref, out_ref, send_sem, recv_sem):
        peer = (1 - jax.lax.axis_index("x"),)
        barrier = pltpu.get_barrier_semaphore()
        pl.semaphore_signal(barrier, 1, device_id=peer, device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, 1)  # the peer is inside this kernel: its out_ref exists
        copy = pltpu.make_async_remote_copy(x_ref, out_ref, send_sem, recv_sem, device_id=peer,
                                            device_id_type=pl.DeviceIdType.MESH)
        copy.start()
        copy.wait_recv()
        copy.wait_send()

    def per_device(x):  # [8, 128] f32 on each device
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=pltpu.InterpretParams(detect_races=True))(x)

    swap = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))
    host = np.arange(16 * 128, dtype=np.float32).reshape(16, 128)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")),
                                     lambda index: host[index])
    print(f"process {process_id}: running the kernel", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(DUMP_EVERY_S, repeat=True)
    swap(x).block_until_ready()
    faulthandler.cancel_dump_traceback_later()
    print(f"process {process_id}: ran", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
