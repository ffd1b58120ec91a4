"""How a packed weight-sync message gets from its sender to its receivers: one module each.

The executor (`weight_sync.executor.run_plan`) plans, gathers, packs, checks and hands messages
to sinks; per sender and per sync, `weight_sync.negotiate` picks one transport for its group,
and both ends then talk to it through the same few calls:

    sender:    wait_slot(index)   before packing bucket `index` into produce slot index % 2
               send(view, index)  a packed message (header, then payload) of that bucket
               finish_posts()     before this rank drains as a receiver (a rank may be both)
               drain()            every send of this sync completed
    receiver:  post(message, sender, seq, group, bucket_index)
                                  message `seq` of `sender` is next on the schedule; once it
                                  has arrived, the transport hands it to `deliver(view, message,
                                  sender, seq)` (checked there, then loaded)
               drain()            every posted message delivered

- `collective`: each message broadcast on the sender's group: gloo between hosts (the host
  bridge, CPU slots) and NCCL on GPUs (the device bridge: the same calls on CUDA slots, whose
  views then reach an engine by CUDA IPC, `engines.sglang.handover`). Optionally through a
  codec (`Codec`, the delta codec of `weight_sync.delta_wire`): a layer that turns a packed
  message into a header and encoded bytes and back, not a transport of its own.
- `shared_memory`: one host; the sender's produce slots are mapped by its receivers, and only
  each message's header crosses, as a signal that it is ready.
"""
