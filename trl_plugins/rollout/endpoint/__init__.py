"""The agent endpoint: train agents written against the OpenAI chat-completions API (rollout plugin
``agent_endpoint``; docs/agents.md)."""

from trl_plugins.rollout.endpoint.agent import AGENT_REWARD, ROW_REWARD, AgentEndpointRollout, record_rewards

__all__ = ["AgentEndpointRollout", "AGENT_REWARD", "ROW_REWARD", "record_rewards"]
