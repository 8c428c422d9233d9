"""The event bus: protobuf envelopes over Kafka, at least once, effect exactly once.

Services wire it through harnessrl.service_bus (a producer, consumers as handler tables);
the pieces:

producer = Producer(config.kafka, config.producer, name="reward/r-0")
consumer = Consumer(config.kafka, config.consumer, topics=[events.EPISODES],
                    group_id="harnessrl.reward", handler=handle, producer=producer)
"""

from harnessrl.bus.consumer import Consumer, Context, Handler, Hold, Record
from harnessrl.bus.kafka import TopicError, client_kwargs, ensure_topics
from harnessrl.bus.metrics import BusMetrics
from harnessrl.bus.producer import Ack, Producer, ProducerClosedError

__all__ = [
    "Ack",
    "BusMetrics",
    "Consumer",
    "Context",
    "Handler",
    "Hold",
    "Producer",
    "ProducerClosedError",
    "Record",
    "TopicError",
    "client_kwargs",
    "ensure_topics",
]
