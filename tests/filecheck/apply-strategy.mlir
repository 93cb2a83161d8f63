// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: dp=2"}' | filecheck %s --check-prefix=DP2
// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0-3]: dp=4"}' | filecheck %s --check-prefix=DP4

// Parameters become replicated over the group's devices, batch inputs split along dim 0
// over the data-parallel degree, a scalar input replicated; values that are not leaves
// keep their plain types for propagate-layouts.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %s = graph.input "s" : tensor<f32>
    %y = graph.matmul %x, %w : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
    graph.output "y", %y : tensor<8x3xf32>
    func.return
  }
}

// DP2:      %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>
// DP2-NEXT: %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// DP2-NEXT: %s = graph.input "s" : tensor<f32, #dist.layout<"[0,1]: dup=2">>
// DP2-NEXT: %y = graph.matmul %x, %w : (tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x3xf32, #dist.layout<"[0,1]: dup=2">>) -> tensor<8x3xf32>{{$}}
// DP2-NEXT: graph.output "y", %y : tensor<8x3xf32>{{$}}

// DP4:      %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0-3]: dup=4">>
// DP4-NEXT: %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=4">>
// DP4-NEXT: %s = graph.input "s" : tensor<f32, #dist.layout<"[0-3]: dup=4">>
// DP4-NEXT: %y = graph.matmul {{.*}} -> tensor<8x3xf32>{{$}}
